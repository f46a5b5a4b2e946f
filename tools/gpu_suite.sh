#!/usr/bin/env bash
# One bounded run of every GPU check and benchmark, for a GPU machine where nothing can be installed.
#
#   OUT=/some/dir bash tools/gpu_suite.sh            (defaults: OUT=./gpu_out, BUDGET_S=450)
#
# Uses the machine's own python3 with PYTHONPATH set to this repo (never `make install`). For each
# project, in order: its gpu_checks.sh if present (extension builds, compute-sanitizer), its tests on the
# device (GPU-marked ones included), then its benchmark in --quick mode writing records to $OUT/results.
# Every step has its own timeout and the whole run stops starting new steps after BUDGET_S seconds.
# The last thing printed is the summary table (tools/gpu_summary.py).
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$REPO/gpu_out}
BUDGET_S=${BUDGET_S:-450}
PY=${PYTHON:-python3}
mkdir -p "$OUT/results" "$OUT/logs"
export KERNEL_LAB_CACHE="$OUT/cache"

$PY tools/environment.py --json > "$OUT/environment.json" 2> "$OUT/logs/environment.err" || true
$PY tools/environment.py | tail -n 20

over_budget() { [ "$SECONDS" -ge "$BUDGET_S" ]; }

for dir in projects/[0-9][0-9]_*/; do
  name=$(basename "$dir")
  if over_budget; then echo "[$name] skipped: suite budget of ${BUDGET_S}s spent" | tee -a "$OUT/logs/skipped.txt"; continue; fi
  echo "== $name ($SECONDS s)"
  if [ -f "$dir/gpu_checks.sh" ]; then
    OUT="$OUT" timeout 150 bash "$dir/gpu_checks.sh" > "$OUT/logs/$name.checks.log" 2>&1
    echo "   gpu_checks.sh rc=$?"
  fi
  if ls "$dir"/test_*.py > /dev/null 2>&1; then
    timeout 150 $PY -m pytest -q -m "gpu or not gpu" -p no:cacheprovider "$dir" \
      --junitxml="$OUT/logs/$name.junit.xml" > "$OUT/logs/$name.pytest.log" 2>&1
    echo "   pytest rc=$? ($(tail -n 1 "$OUT/logs/$name.pytest.log"))"
  fi
  if [ -f "$dir/benchmark.py" ] && ! over_budget; then
    timeout 120 $PY "$dir/benchmark.py" --quick --out "$OUT/results" > "$OUT/logs/$name.bench.log" 2>&1
    echo "   benchmark rc=$?"
  fi
done

echo
echo "total ${SECONDS}s; records in $OUT/results; logs in $OUT/logs"
$PY tools/gpu_summary.py "$OUT"
