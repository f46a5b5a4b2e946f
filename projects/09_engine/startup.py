"""Cold-start time to the first token, from a fresh process, with a warm model cache.

    python projects/09_engine/startup.py [--model FILE.gguf] [--runs 5] [--vllm-runs 3] [--out results]

Each run launches a new process and stops the clock at the first byte it prints on stdout:
`kernel-lab generate "<prompt>" --max-tokens 8` streams the answer there, and the vLLM baseline (the
Python of project 08's environment, `--vllm-python`; skipped when absent) builds `vllm.LLM` (eager, fp32)
on the same exported directory, generates one token and prints a marker. The clock includes the
interpreter start and every import. One untimed run first fills the caches (the exported model
directory, tokenizer.json, Python bytecode); the record says so. With `--model` (a GGUF file; default the
bundled model) the record is that model's and also gives the engine's resident weight bytes against the
file's tensor bytes (one in-process load after the timed runs).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kernel_lab.bench.throughput import vllm_cpu_env  # noqa: E402
from kernel_lab.harness.bench import Timing, summarize  # noqa: E402
from kernel_lab.harness.results import ResultRecord  # noqa: E402

PROMPT = "What is the capital of France?"
VLLM_SCRIPT = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=2048,
          kv_cache_memory_bytes=1 << 30)
llm.generate([sys.argv[2]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
print("FIRST-TOKEN", flush=True)
"""
ENV = {"TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **vllm_cpu_env()}


def time_to_first_output(cmd: list[str], marker: bytes | None, timeout: float = 600.0) -> float:
    """Seconds from launching `cmd` to its first stdout byte (or to the line containing `marker`)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, **ENV})
    try:
        while True:
            chunk = proc.stdout.readline() if marker else proc.stdout.read(1)
            if not chunk:
                raise RuntimeError(f"{cmd[:4]} exited (code {proc.wait()}) before its first output")
            if marker is None or marker in chunk:
                elapsed = time.perf_counter() - start
                break
            if time.perf_counter() - start > timeout:
                raise TimeoutError(f"{cmd[:4]}: no first output in {timeout} s")
    finally:
        proc.kill()
        proc.wait()
    return elapsed


def measure(cmd, marker, runs: int) -> Timing:
    time_to_first_output(cmd, marker)  # untimed: fills the caches
    samples = [time_to_first_output(cmd, marker) * 1e3 for _ in range(runs)]
    return summarize(samples, {"kind": "process launch to first stdout output, wall clock",
                                         "untimed_runs_first": 1, "runs": runs})


def weight_memory(model: str) -> dict:
    """The engine's resident weight bytes on `model` (a GGUF) against the bytes of the file's tensors."""
    from kernel_lab.engine import LLMEngine
    from kernel_lab.models.gguf_file import GGUFFile

    tensor_bytes = GGUFFile(model).tensor_data_bytes()
    resident = LLMEngine(model=model, device="cpu").stats()["resident_weight_bytes"]
    return {"resident_weight_bytes": resident, "file_tensor_bytes": tensor_bytes, "ratio": resident / tensor_bytes,
            "target_ratio": 1.1}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--vllm-runs", type=int, default=3)
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--target-s", type=float, default=None,
                        help="the target the record states (default: 10 s for the bundled model, 5 s otherwise)")
    parser.add_argument("--out", default=str(REPO / "results"))
    args = parser.parse_args(argv)
    from kernel_lab.models.loader import resolve_model_dir

    model_args = ["--model", args.model] if args.model else []
    label = "bundled SmolLM2-135M" if args.model is None else f"{Path(args.model).parent.name} {Path(args.model).stem}"
    target_s = args.target_s or (10.0 if args.model is None else 5.0)
    ours = measure([sys.executable, "-m", "kernel_lab.cli", "generate", PROMPT, "--max-tokens", "8",
                    "--device", "cpu", *model_args], None, args.runs)
    # What any PyTorch program pays before its first line: the part of the cold start the engine cannot cut.
    torch_import = measure([sys.executable, "-c", "import torch; print('imported')"], None, args.runs)
    baselines = {}
    if args.model is None and Path(args.vllm_python).exists() and args.vllm_runs:
        model_dir = str(resolve_model_dir(None))
        baselines["vLLM CPU (eager) LLM + generate 1 token"] = measure(
            [args.vllm_python, "-c", VLLM_SCRIPT, model_dir, PROMPT], b"FIRST-TOKEN", args.vllm_runs)
    title = "cold start to first token" + ("" if args.model is None else f" on {label}")
    record = ResultRecord("09_engine", title, "cpu",
                          description="a fresh process per run, warm model cache (one untimed run first); "
                                      f"kernel-lab generate {PROMPT!r} (chat template, {label}, "
                                      f"float32 activations, weights=auto) until its first streamed byte; "
                                      f"target <= {target_s:g} s")
    extra = {"metric": {"unit": "ms", "value": ours.median_ms}, "target_s": target_s}
    if args.model:
        extra["weight_memory"] = weight_memory(args.model)
    record.add_case("kernel-lab generate, first token", shape={"prompt": PROMPT}, dtype="float32", timing=ours,
                    baselines=baselines, extra=extra)
    record.add_case("python -c 'import torch' alone", shape={}, dtype="-", timing=torch_import,
                    extra={"metric": {"unit": "ms", "value": torch_import.median_ms},
                           "quantity": "the floor under any torch program's cold start on this machine"})
    line = (("" if args.model is None else f"{label}: ") +
            f"first token {ours.median_ms / 1e3:.1f} s after process start (median of {args.runs}; "
            f"target {target_s:g} s)")
    if "weight_memory" in extra:
        line += f"; resident weights {extra['weight_memory']['ratio']:.2f}x the file's tensor bytes"
    line += f"; import torch alone {torch_import.median_ms / 1e3:.1f} s"
    for name, t in baselines.items():
        line += f"; {name}: {t.median_ms / 1e3:.1f} s"
    record.set_headline(line)
    record.emit(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
