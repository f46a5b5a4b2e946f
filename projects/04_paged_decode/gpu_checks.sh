#!/usr/bin/env bash
# GPU-machine steps for project 04 (called by tools/gpu_suite.sh with $OUT set; plain python3, no installs):
# load the CUDA extension (kernel_lab/csrc; the suite has built it already, so this imports the cached build),
# then run compute-sanitizer memcheck and racecheck on a small case covering every decode path, each under
# SANITIZER_TIMEOUT_S (default 20 s: tools/gpu_plan.py caps this whole step at 45 s). Logs go to $OUT/sanitizer/.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$PWD/gpu_out}
PY=${PYTHON:-python3}
PART=${PART:-decode}
TAG=${TAG:-04}
export KERNEL_LAB_CACHE=${KERNEL_LAB_CACHE:-$OUT/cache}
mkdir -p "$OUT/sanitizer"
status=0

start=$SECONDS
if ! $PY -m kernel_lab.ops.cuda_extension > "$OUT/sanitizer/${TAG}_build.log" 2>&1; then
  echo "extension build FAILED (log: $OUT/sanitizer/${TAG}_build.log)"
  tail -n 40 "$OUT/sanitizer/${TAG}_build.log"
  exit 1
fi
echo "extension built or loaded in $((SECONDS - start)) s"
grep -E "registers|spill" "$OUT/sanitizer/${TAG}_build.log" | sort | uniq -c | sort -rn | head -n 5 || true

SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
if [ -z "$SANITIZER" ]; then
  echo "compute-sanitizer not found on this machine: skipped" | tee "$OUT/sanitizer/${TAG}_skipped.txt"
  exit 0
fi
for tool in memcheck racecheck; do
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZER_TIMEOUT_S:-20}" "$SANITIZER" --tool "$tool" --error-exitcode 99 \
    $PY projects/04_paged_decode/sanitizer_case.py --part "$PART" > "$OUT/sanitizer/${TAG}_$tool.log" 2>&1
  rc=$?
  echo "compute-sanitizer $tool rc=$rc ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer/${TAG}_$tool.log" | tail -n 1))"
  [ $rc -eq 0 ] || status=1
done
exit $status
