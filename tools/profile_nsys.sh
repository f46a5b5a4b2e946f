#!/usr/bin/env bash
# Nsight Systems timeline of one project's benchmark; NVTX ranges label every benchmarked case.
#   bash tools/profile_nsys.sh 01_rmsnorm [extra benchmark args]
set -euo pipefail
cd "$(dirname "$0")/.."
project=${1:?usage: tools/profile_nsys.sh PROJECT [benchmark args]}; shift || true
if ! command -v nsys > /dev/null || ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
  echo "profile_nsys.sh needs a CUDA GPU and Nsight Systems (nsys) on PATH; neither is usable here." >&2
  exit 2
fi
mkdir -p profiles
PYTHONPATH=$PWD nsys profile --trace=cuda,nvtx,osrt --force-overwrite=true \
  -o "profiles/${project}" python3 "projects/${project}/benchmark.py" --quick "$@"
nsys stats --report cuda_gpu_kern_sum,nvtx_sum "profiles/${project}.nsys-rep"
