#!/usr/bin/env bash
# One bounded run of the GPU checks, benchmarks and device tests, for a GPU machine where nothing can be
# installed.
#
#   OUT=/some/dir bash tools/gpu_suite.sh            (defaults: OUT=./gpu_out, BUDGET_S=450)
#   bash tools/gpu_suite.sh --plan                   (print the phases, steps and caps; runs nothing, needs no GPU)
#
# Uses the machine's own python3 with PYTHONPATH set to this repo (never `make install`). The steps, their
# phases and their caps come from tools/gpu_plan.py (modal_app.py reads the same plan; its docstring says
# where the caps come from and why this order). The plan is printed before anything runs. Four phases, none
# overlapping the next:
#   1. setup, serial: the environment record, the CUDA extension build (once, timed, when a project needs it);
#   2. checks, serial: each project's gpu_checks.sh (compute-sanitizer);
#   3. bench, serial, one process alone on the GPU: each project's benchmark in --quick mode, records to
#      $OUT/results, projects 04-07 first;
#   4. tests, in parallel: each project's tests on the device without the compile-only ones (CI runs those),
#      one pytest process per project, TEST_PROCESSES at a time (min(8, nproc / 2); SUITE_TEST_PROCESSES
#      overrides), OMP_NUM_THREADS=2 each, longest first, until every one has ended or the deadline.
#
# The budget is a hard deadline (at most 480 s, the device tool's 10-minute call limit less a margin). The
# test phase keeps a reserve (TEST_RESERVE_S, from the plan): every serial step runs under the smaller of its
# cap and the time left before that reserve, so the benchmarks cannot eat the tests' time, and the tests get
# all the time the serial steps leave, each pytest under min(cap, time left). A step that runs out is
# interrupted (SIGINT, then SIGKILL 5 s later): pytest still writes the results of the tests it finished, and
# every finished test is also logged as it ends ($OUT/logs/<project>.tests.jsonl), so a cut project reports
# partial results, not "not run". When the extension can be neither built nor loaded (no ninja, g++ or
# matching nvcc), the build says why in one line and the steps that need it are skipped with that line (the
# tests that need it skip themselves). Each step's exit status and time go to $OUT/logs/steps.tsv (tests in
# the order they end). The summary table (tools/gpu_summary.py, also in $OUT/summary.txt) is printed last,
# also when the suite itself is interrupted, and the suite's own output is in $OUT/logs/suite.log.
#
# Last, everything under $OUT except the extension build cache ($OUT/cache) is packed into one archive,
# $OUT/gpu_suite_out.tgz (records, logs, JUnit and per-test files, sanitizer logs, environment.json,
# summary.txt), beside the files themselves: a device tool that returns only a few files from $OUT brings the
# whole run back in that one (`tar -xzf gpu_suite_out.tgz -C DIR`). Triton's own cache is left at its default
# (~/.triton/cache), so a second run on the same machine starts warm.
#
# SUITE_PROJECTS (a glob, default projects/[0-9][0-9]_*/) picks the projects, SUITE_PHASES (default
# "checks bench tests"; setup always runs) the phases: `--plan` names the SUITE_PHASES/SUITE_PROJECTS of
# further runs for what may not fit one. Needs bash 4 or later.
set -u
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
export PY  # the plan's commands say $PY
BUDGET_S=${BUDGET_S:-450}
PHASES=${SUITE_PHASES:-checks bench tests}
# shellcheck disable=SC2206  # the glob is meant to expand
DIRS=(${SUITE_PROJECTS:-projects/[0-9][0-9]_*/})
PLAN_ARGS=(--budget "$BUDGET_S" --phases "$PHASES" --processes "${SUITE_TEST_PROCESSES:-0}")
if [ "${1:-}" = "--plan" ]; then
  exec "$PY" tools/gpu_plan.py "${PLAN_ARGS[@]}" "${DIRS[@]}"  # describes the 16-core validation box
fi
CORES=$(nproc 2>/dev/null || echo 1)
PLAN_ARGS+=(--cores "$CORES")
# BUDGET_S (capped), USABLE_S, SERIAL_DEADLINE_S, TEST_RESERVE_S, TEST_PROCESSES, TEST_THREADS, TEST_WALL_S,
# KILL_GRACE_S, SUMMARY_TIMEOUT_S, PACK_TIMEOUT_S
VARS=$("$PY" tools/gpu_plan.py --vars "${PLAN_ARGS[@]}" "${DIRS[@]}") || exit 2
while IFS='=' read -r name value; do
  case $name in
    BUDGET_S|USABLE_S|SERIAL_DEADLINE_S|TEST_RESERVE_S|TEST_PROCESSES|TEST_THREADS|TEST_WALL_S|KILL_GRACE_S|SUMMARY_TIMEOUT_S|PACK_TIMEOUT_S)
      printf -v "$name" '%s' "$value" ;;
  esac
done <<< "$VARS"
OUT=${OUT:-$REPO/gpu_out}
export OUT
mkdir -p "$OUT/results" "$OUT/logs"
ARCHIVE="$OUT/gpu_suite_out.tgz"
rm -f "$ARCHIVE"
export KERNEL_LAB_CACHE="$OUT/cache"
STEPS="$OUT/logs/steps.tsv"
printf 'project\tstep\trc\tseconds\tlimit_s\tnote\n' > "$STEPS"
exec > >(tee "$OUT/logs/suite.log") 2>&1
TEE_PID=$!

declare -A RUNNING=()  # pid of a test's `timeout` -> "project<TAB>start<TAB>limit<TAB>log"

stop_tests() {  # the suite itself was interrupted: SIGINT the running tests, SIGKILL them after the grace
  local pid waited=0
  [ ${#RUNNING[@]} -gt 0 ] || return 0
  echo "   interrupting ${#RUNNING[@]} running test process(es)"
  for pid in "${!RUNNING[@]}"; do kill -INT "$pid" 2>/dev/null; done
  while [ $waited -lt "$KILL_GRACE_S" ]; do
    local alive=0
    for pid in "${!RUNNING[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive -eq 1 ] || break
    sleep 1; waited=$((waited + 1))
  done
  for pid in "${!RUNNING[@]}"; do
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null  # timeout leads its own process group
    wait "$pid" 2>/dev/null
    finish_test "$pid" 130
  done
}

summary() {
  trap - EXIT INT TERM
  stop_tests
  echo
  echo "total ${SECONDS}s of a ${BUDGET_S}s deadline; records in $OUT/results; logs in $OUT/logs"
  timeout "$SUMMARY_TIMEOUT_S" "$PY" tools/gpu_summary.py "$OUT" > "$OUT/summary.txt" 2>&1
  cat "$OUT/summary.txt"
  # One file carries the run back: everything but the extension cache (and the archive itself). tar exits
  # with 1 when a file changed while it was read (suite.log, which this very output goes to): still packed.
  local rc err
  err=$(timeout "$PACK_TIMEOUT_S" tar -czf "$ARCHIVE.part" -C "$OUT" --warning=no-file-changed --exclude=./cache \
    --exclude=./gpu_suite_out.tgz --exclude=./gpu_suite_out.tgz.part . 2>&1)
  rc=$?
  if [ $rc -le 1 ] && mv "$ARCHIVE.part" "$ARCHIVE"; then
    echo "packed into $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1)) at ${SECONDS}s${err:+; tar: ${err##*$'\n'}}"
  else
    rm -f "$ARCHIVE.part"
    echo "packing $ARCHIVE failed (tar rc $rc$([ $rc -eq 124 ] && echo ', timed out'): ${err##*$'\n'}); the files are under $OUT"
  fi
  exec >&- 2>&-
  wait "$TEE_PID" 2>/dev/null
}
trap summary EXIT
trap 'exit 130' INT TERM

"$PY" tools/gpu_plan.py "${PLAN_ARGS[@]}" "${DIRS[@]}"
mapfile -t PLAN < <("$PY" tools/gpu_plan.py --tsv "${PLAN_ARGS[@]}" "${DIRS[@]}")

left_before() { echo $(($1 - SECONDS)); }  # seconds left before an elapsed-time mark
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >> "$STEPS"; }
limit_for() {  # cap, mark: min(cap, time left before mark)
  local left
  left=$(left_before "$2")
  echo $(( $1 < left ? $1 : left ))
}

# ---- phases 1-3: one step at a time, every one ended before SERIAL_DEADLINE_S (the tests' reserve)
echo "== serial phases: setup, checks, benchmarks until ${SERIAL_DEADLINE_S}s; the tests keep ${TEST_RESERVE_S}s"
EXTENSION_UNAVAILABLE=""
TESTS=()
shown=""
for line in "${PLAN[@]}"; do
  IFS=$'\t' read -r phase project step cap log needs_extension _planned command <<< "$line"
  if [ "$phase" = tests ]; then
    TESTS+=("$line")
    continue
  fi
  if [ "$phase/$project" != "$shown" ]; then
    echo "== $phase: $project (${SECONDS}s)"
    shown="$phase/$project"
  fi
  if [ "$needs_extension" = 1 ] && [ -n "$EXTENSION_UNAVAILABLE" ]; then
    record "$project" "$step" skipped 0 0 "$EXTENSION_UNAVAILABLE"
    echo "   $step: skipped, $EXTENSION_UNAVAILABLE"
    continue
  fi
  limit=$(limit_for "$cap" "$SERIAL_DEADLINE_S")
  if [ "$limit" -lt 5 ]; then
    record "$project" "$step" skipped 0 0 deadline
    echo "   $step: skipped, the serial phases' deadline (${SERIAL_DEADLINE_S}s) reached"
    continue
  fi
  echo "   $step (cap ${cap} s, limit ${limit} s): $command"
  start=$SECONDS
  timeout -s INT -k "$KILL_GRACE_S" "$limit" bash -c "exec $command" < /dev/null > "$OUT/$log" 2>&1
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
    build) [ -n "$note" ] && echo "   $note" ;;
  esac
done

# ---- phase 4: the device tests, TEST_PROCESSES concurrent pytest processes, until USABLE_S
finish_test() {  # pid, rc: record a test process that has ended
  local project start limit log rc=$2
  IFS=$'\t' read -r project start limit log <<< "${RUNNING[$1]}"
  unset "RUNNING[$1]"
  [ "$rc" -eq 137 ] && rc=124
  record "$project" pytest "$rc" "$((SECONDS - start))" "$limit" ""
  echo "   $project tests rc=$rc$([ "$rc" -eq 124 ] && echo ' (interrupted at its limit)') in $((SECONDS - start)) s:" \
    "$(tail -n 1 "$OUT/$log" 2>/dev/null)"
}

reap_one() {  # wait for one running test process to end, and record it
  # Polls: bash reaps an ended child at once (kill -0 then fails) and keeps its status for `wait PID`.
  # Not `wait -n`: when several children end together (the deadline's SIGKILL), bash 5.2 loses all but one
  # of them from its job table and `wait -n` then fails at once for the rest, a busy loop.
  local pid rc
  while :; do
    for pid in "${!RUNNING[@]}"; do
      if ! kill -0 "$pid" 2>/dev/null; then
        wait "$pid"; rc=$?
        finish_test "$pid" "$rc"
        return
      fi
    done
    sleep 0.5
  done
}

if [ ${#TESTS[@]} -gt 0 ]; then
  echo "== tests: ${#TESTS[@]} pytest processes, ${TEST_PROCESSES} at a time (${CORES} cores," \
    "OMP_NUM_THREADS=${TEST_THREADS}), from ${SECONDS}s until ${USABLE_S}s at the latest (expected ${TEST_WALL_S}s)"
  next=0
  while [ $next -lt ${#TESTS[@]} ] || [ ${#RUNNING[@]} -gt 0 ]; do
    while [ $next -lt ${#TESTS[@]} ] && [ ${#RUNNING[@]} -lt "$TEST_PROCESSES" ]; do
      IFS=$'\t' read -r _phase project step cap log _needs_extension _planned command <<< "${TESTS[$next]}"
      next=$((next + 1))
      rm -f "$OUT/logs/$project.junit.xml" "$OUT/logs/$project.tests.jsonl"
      limit=$(limit_for "$cap" "$USABLE_S")
      if [ "$limit" -lt 5 ]; then
        record "$project" "$step" skipped 0 0 deadline
        echo "   $project tests: skipped, deadline reached"
        continue
      fi
      echo "   start $project tests at ${SECONDS}s (cap ${cap} s, limit ${limit} s): $command"
      KERNEL_LAB_TEST_LOG="$OUT/logs/$project.tests.jsonl" OMP_NUM_THREADS=$TEST_THREADS \
        MKL_NUM_THREADS=$TEST_THREADS TORCHINDUCTOR_COMPILE_THREADS=1 \
        timeout -s INT -k "$KILL_GRACE_S" "$limit" bash -c "exec $command" < /dev/null > "$OUT/$log" 2>&1 &
      RUNNING[$!]="$project"$'\t'"$SECONDS"$'\t'"$limit"$'\t'"$log"
    done
    [ ${#RUNNING[@]} -gt 0 ] && reap_one
  done
  echo "== tests ended at ${SECONDS}s"
fi
