#!/usr/bin/env bash
# Nsight Compute profile of one project's kernels, at the GPU's default clocks (--clock-control none), so
# that bandwidth numbers are comparable with the benchmarks'.
#   bash tools/profile_ncu.sh 01_rmsnorm [kernel-name-regex] [extra benchmark args]
set -euo pipefail
cd "$(dirname "$0")/.."
project=${1:?usage: tools/profile_ncu.sh PROJECT [KERNEL_REGEX] [benchmark args]}; shift || true
regex=${1:-.}; shift || true
if ! command -v ncu > /dev/null || ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
  echo "profile_ncu.sh needs a CUDA GPU and Nsight Compute (ncu) on PATH; neither is usable here." >&2
  exit 2
fi
mkdir -p profiles
PYTHONPATH=$PWD ncu --clock-control none --set full --kernel-name "regex:${regex}" --launch-count 20 \
  --force-overwrite -o "profiles/${project}" python3 "projects/${project}/benchmark.py" --quick "$@"
ncu --import "profiles/${project}.ncu-rep" --page details --print-summary per-kernel | head -n 80
