"""`kernel-lab bench throughput --backend vllm` (project 09's baseline runner) in the environment that has
vLLM: it must run the workload it was given and report it, since project 09's CPU record compares
against it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_bench_throughput_vllm_backend_runs_the_workload(tmp_path):
    out = tmp_path / "vllm.json"
    from kernel_lab.bench.throughput import vllm_cpu_env

    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1", **vllm_cpu_env("0")}
    cmd = [sys.executable, "-m", "kernel_lab.cli", "bench", "throughput", "--backend", "vllm",
           "--dataset-name", "fixed", "--num-prompts", "3", "--input-len", "12", "--output-len", "5",
           "--max-num-seqs", "2", "--dtype", "float32", "--device", "cpu", "--output-json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["backend"] == "vllm" and summary["device"] == "cpu" and summary["dtype"] == "float32"
    assert summary["num_requests"] == 3 and summary["concurrency"] == 2
    assert summary["total_output_tokens"] == 15 and summary["total_prompt_tokens"] == 36
    assert summary["elapsed_time"] > 0
    assert abs(summary["output_tokens_per_second"] - 15 / summary["elapsed_time"]) < 1e-6
    assert "vllm" in proc.stdout and "Throughput:" in proc.stdout
