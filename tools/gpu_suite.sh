#!/usr/bin/env bash
# One bounded run of the GPU checks and benchmarks, for a GPU machine where nothing can be installed.
#
#   OUT=/some/dir bash tools/gpu_suite.sh            (defaults: OUT=./gpu_out, BUDGET_S=450)
#   bash tools/gpu_suite.sh --plan                   (print the steps and their caps; runs nothing, needs no GPU)
#
# Uses the machine's own python3 with PYTHONPATH set to this repo (never `make install`). The steps, their
# order and their caps come from tools/gpu_plan.py (modal_app.py reads the same plan): the environment
# record, the CUDA extension build (once, first, timed), then per project its gpu_checks.sh, its tests on the
# device without the compile-only ones (CI runs those), and its benchmark in --quick mode writing records to
# $OUT/results; projects 04-07 first. The plan is printed before anything runs.
#
# The budget is a hard deadline (at most 480 s, the device tool's 10-minute call limit less a margin): each
# step's timeout is the smaller of its own cap and the time left, so no step can start or run past it. A
# step that runs out is interrupted (SIGINT, then SIGKILL 5 s later): pytest still writes the results of
# the tests it finished, and every finished test is also logged as it ends ($OUT/logs/<project>.tests.jsonl),
# so a timed-out project reports partial results, not "not run". When the extension can be neither built
# nor loaded (no ninja, g++ or matching nvcc), the build says why in one line and the steps that need it are
# skipped with that line (the tests that need it skip themselves). Each step's exit status and time go to
# $OUT/logs/steps.tsv. The summary table (tools/gpu_summary.py) is printed last, also when the suite itself
# is interrupted. SUITE_PROJECTS (a glob, default projects/[0-9][0-9]_*/) picks the projects.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
export PY  # the plan's commands say $PY
BUDGET_S=${BUDGET_S:-450}
# shellcheck disable=SC2206  # the glob is meant to expand
DIRS=(${SUITE_PROJECTS:-projects/[0-9][0-9]_*/})
if [ "${1:-}" = "--plan" ]; then
  exec $PY tools/gpu_plan.py --budget "$BUDGET_S" "${DIRS[@]}"
fi
MAX_BUDGET_S=$($PY -c "import sys; sys.path.insert(0, 'tools'); import gpu_plan; print(gpu_plan.MAX_BUDGET_S, gpu_plan.SUMMARY_RESERVE_S, gpu_plan.SUMMARY_TIMEOUT_S)")
read -r MAX_BUDGET_S SUMMARY_RESERVE_S SUMMARY_TIMEOUT_S <<< "$MAX_BUDGET_S"
[ "$BUDGET_S" -le "$MAX_BUDGET_S" ] || BUDGET_S=$MAX_BUDGET_S
OUT=${OUT:-$REPO/gpu_out}
export OUT
mkdir -p "$OUT/results" "$OUT/logs"
export KERNEL_LAB_CACHE="$OUT/cache"
STEPS="$OUT/logs/steps.tsv"
printf 'project\tstep\trc\tseconds\tlimit_s\tnote\n' > "$STEPS"

summary() {
  trap - EXIT INT TERM
  echo
  echo "total ${SECONDS}s of a ${BUDGET_S}s deadline; records in $OUT/results; logs in $OUT/logs"
  timeout "$SUMMARY_TIMEOUT_S" $PY tools/gpu_summary.py "$OUT"
}
trap summary EXIT
trap 'exit 130' INT TERM

$PY tools/gpu_plan.py --budget "$BUDGET_S" "${DIRS[@]}"
mapfile -t PLAN < <($PY tools/gpu_plan.py --tsv --budget "$BUDGET_S" "${DIRS[@]}")

time_left() { echo $((BUDGET_S - SUMMARY_RESERVE_S - SECONDS)); }
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >> "$STEPS"; }

EXTENSION_UNAVAILABLE=""
project_shown=""
for line in "${PLAN[@]}"; do
  IFS=$'\t' read -r project step cap log needs_extension _planned command <<< "$line"
  if [ "$project" != "$project_shown" ]; then
    echo "== $project ($SECONDS s)"
    project_shown=$project
  fi
  case $step in pytest) rm -f "$OUT/logs/$project.junit.xml" "$OUT/logs/$project.tests.jsonl" ;; esac
  if [ "$needs_extension" = 1 ] && [ -n "$EXTENSION_UNAVAILABLE" ]; then
    record "$project" "$step" skipped 0 0 "$EXTENSION_UNAVAILABLE"
    echo "   $step: skipped, $EXTENSION_UNAVAILABLE"
    continue
  fi
  left=$(time_left)
  limit=$(( cap < left ? cap : left ))
  if [ "$limit" -lt 5 ]; then
    record "$project" "$step" skipped 0 0 deadline
    echo "   $step: skipped, deadline reached"
    continue
  fi
  echo "   $step (cap ${cap} s, limit ${limit} s): $command"
  start=$SECONDS
  KERNEL_LAB_TEST_LOG="$OUT/logs/$project.tests.jsonl" \
    timeout -s INT -k 5 "$limit" bash -c "exec $command" < /dev/null > "$OUT/$log" 2>&1
  rc=$?
  [ $rc -eq 137 ] && rc=124   # killed after the interrupt: still a timeout
  note=""
  if [ "$step" = build ] && [ $rc -ne 0 ]; then
    # rc 3: a build tool is missing (the log's last line says which); anything else: the build failed.
    EXTENSION_UNAVAILABLE=$([ $rc -eq 3 ] && tail -n 1 "$OUT/$log" || echo "extension build failed (rc $rc, $OUT/$log)")
    export KERNEL_LAB_EXTENSION_UNAVAILABLE=$EXTENSION_UNAVAILABLE  # tests marked cuda_extension skip with it
    note=$EXTENSION_UNAVAILABLE
  fi
  record "$project" "$step" "$rc" "$((SECONDS - start))" "$limit" "$note"
  echo "   $step rc=$rc$([ $rc -eq 124 ] && echo ' (timed out)') in $((SECONDS - start)) s"
  case $step in
    environment) tail -n 20 "$OUT/$log" ;;
    pytest) echo "   $(tail -n 1 "$OUT/$log")" ;;
    build) [ -n "$note" ] && echo "   $note" ;;
  esac
done
