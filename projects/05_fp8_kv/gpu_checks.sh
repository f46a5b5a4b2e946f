#!/usr/bin/env bash
# GPU-machine steps for project 05: the shared extension build (cached after project 04's run) and
# compute-sanitizer memcheck/racecheck on the fp8 paths (write_kv requantisation, fp8 decode).
set -u
cd "$(dirname "$0")/../.."
PART=fp8 TAG=05 exec bash projects/04_paged_decode/gpu_checks.sh
