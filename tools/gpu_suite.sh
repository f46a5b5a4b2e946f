#!/usr/bin/env bash
# One bounded run of every GPU check and benchmark, for a GPU machine where nothing can be installed.
#
#   OUT=/some/dir bash tools/gpu_suite.sh            (defaults: OUT=./gpu_out, BUDGET_S=450)
#
# Uses the machine's own python3 with PYTHONPATH set to this repo (never `make install`). For each
# project, in order: its gpu_checks.sh if present (extension builds, compute-sanitizer), its tests on the
# device (GPU-marked ones included), then its benchmark in --quick mode writing records to $OUT/results.
#
# The budget is a hard deadline (at most 480 s, the device tool's 10-minute call limit less a margin): each
# step's timeout is the smaller of its own cap and the time left, so no step can start or run past it. A
# step that runs out is interrupted (SIGINT, then SIGKILL 5 s later): pytest still writes the results of
# the tests it finished, and every finished test is also logged as it ends ($OUT/logs/<project>.tests.jsonl),
# so a timed-out project reports partial results, not "not run". Each step's exit status and time go to
# $OUT/logs/steps.tsv. The summary table (tools/gpu_summary.py) is printed last, also when the suite itself
# is interrupted. SUITE_PROJECTS (a glob, default projects/[0-9][0-9]_*/) picks the projects.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$REPO/gpu_out}
MAX_BUDGET_S=480
BUDGET_S=${BUDGET_S:-450}
[ "$BUDGET_S" -le "$MAX_BUDGET_S" ] || BUDGET_S=$MAX_BUDGET_S
SUMMARY_RESERVE_S=10   # the summary's own time, plus the 5 s between SIGINT and SIGKILL of the last step
PY=${PYTHON:-python3}
mkdir -p "$OUT/results" "$OUT/logs"
export KERNEL_LAB_CACHE="$OUT/cache"
STEPS="$OUT/logs/steps.tsv"
printf 'project\tstep\trc\tseconds\tlimit_s\n' > "$STEPS"

summary() {
  trap - EXIT INT TERM
  echo
  echo "total ${SECONDS}s of a ${BUDGET_S}s deadline; records in $OUT/results; logs in $OUT/logs"
  timeout 8 $PY tools/gpu_summary.py "$OUT"
}
trap summary EXIT
trap 'exit 130' INT TERM

time_left() { echo $((BUDGET_S - SUMMARY_RESERVE_S - SECONDS)); }

# run_step PROJECT STEP CAP_S LOG COMMAND...: the command under min(CAP_S, time left); rc 124 = timed out.
run_step() {
  local project=$1 step=$2 cap=$3 log=$4
  shift 4
  local left limit start rc
  left=$(time_left)
  limit=$(( cap < left ? cap : left ))
  if [ "$limit" -lt 5 ]; then
    printf '%s\t%s\tskipped\t0\t0\n' "$project" "$step" >> "$STEPS"
    echo "   $step: skipped, deadline reached"
    return 0
  fi
  start=$SECONDS
  timeout -s INT -k 5 "$limit" "$@" > "$log" 2>&1
  rc=$?
  [ $rc -eq 137 ] && rc=124   # killed after the interrupt: still a timeout
  printf '%s\t%s\t%s\t%s\t%s\n' "$project" "$step" "$rc" "$((SECONDS - start))" "$limit" >> "$STEPS"
  echo "   $step rc=$rc$([ $rc -eq 124 ] && echo ' (timed out)') in $((SECONDS - start)) s"
}

$PY tools/environment.py --json > "$OUT/environment.json" 2> "$OUT/logs/environment.err" || true
timeout 20 $PY tools/environment.py | tail -n 20

for dir in ${SUITE_PROJECTS:-projects/[0-9][0-9]_*/}; do
  dir=${dir%/}
  name=$(basename "$dir")
  echo "== $name ($SECONDS s)"
  if [ -f "$dir/gpu_checks.sh" ]; then
    run_step "$name" gpu_checks 150 "$OUT/logs/$name.checks.log" env OUT="$OUT" bash "$dir/gpu_checks.sh"
  fi
  if ls "$dir"/test_*.py > /dev/null 2>&1; then
    rm -f "$OUT/logs/$name.junit.xml" "$OUT/logs/$name.tests.jsonl"
    run_step "$name" pytest 150 "$OUT/logs/$name.pytest.log" \
      env KERNEL_LAB_TEST_LOG="$OUT/logs/$name.tests.jsonl" \
      $PY -m pytest -q -m "gpu or not gpu" -p no:cacheprovider "$dir" --junitxml="$OUT/logs/$name.junit.xml"
    echo "   $(tail -n 1 "$OUT/logs/$name.pytest.log")"
  fi
  if [ -f "$dir/benchmark.py" ]; then
    run_step "$name" benchmark 120 "$OUT/logs/$name.bench.log" $PY "$dir/benchmark.py" --quick --out "$OUT/results"
  fi
done
