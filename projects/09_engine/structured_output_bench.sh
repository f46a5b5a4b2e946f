#!/usr/bin/env bash
# The cost of structured output: the same random workload with and without a JSON-schema constraint.
set -euo pipefail
cd "$(dirname "$0")/../.."
.venv/bin/kernel-lab serve --max-num-seqs 32 --port 8123 > "${TMPDIR:-/tmp}/kernel-lab-serve.log" 2>&1 &
pid=$!
trap 'kill $pid' EXIT
for i in $(seq 120); do curl -sf http://127.0.0.1:8123/health >/dev/null && break; sleep 1; done
# one warm-up pass of each workload (the grammar cache, the first steps), not recorded
for so in none json-schema; do
  .venv/bin/kernel-lab bench serve --port 8123 --endpoint /v1/chat/completions --dataset-name random \
    --random-input-len 64 --random-output-len 32 --num-prompts 8 --max-concurrency 8 --structured-output $so > /dev/null
done
for so in none json-schema; do
  label=kernel-lab; [ "$so" = none ] || label=kernel-lab-$so
  .venv/bin/kernel-lab bench serve --port 8123 --endpoint /v1/chat/completions --dataset-name random \
    --random-input-len 64 --random-output-len 32 --random-range-ratio 0 --num-prompts 48 \
    --max-concurrency 1,8 --structured-output $so --server-label $label \
    --result-dir results/09_engine/serve-structured-output
done
