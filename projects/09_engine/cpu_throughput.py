"""CPU throughput of the engine against transformers' batched `generate` and vLLM CPU, on the same workload.

    python projects/09_engine/cpu_throughput.py [--concurrency 1 8 32] [--num-prompts 32] [--out results]

For each concurrency it runs `kernel-lab bench throughput` in fresh processes, once per backend, on the
same fixed-length workload (random token ids, greedy, EOS ignored, fp32), and keeps the raw JSON outputs
under <out>/09_engine/raw/. vLLM runs with the Python of project 08's environment (`--vllm-python`,
default .venv-vllm; skipped when it is absent), eager, one process, bound to as many cores as the others
get threads. It then writes one result record with a case per concurrency: our output tok/s, with each
baseline's wall time on the same workload (so `speedup` is the throughput ratio). Long: minutes per point
on a 2-core CPU, dominated by concurrency 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kernel_lab.bench.throughput import vllm_cpu_env  # noqa: E402
from kernel_lab.harness.bench import Timing  # noqa: E402
from kernel_lab.harness.results import ResultRecord  # noqa: E402
from kernel_lab.models.llama import ModelConfig  # noqa: E402
from kernel_lab.models.loader import load_config, resolve_model_dir  # noqa: E402

BASELINES = {"transformers": "transformers generate", "vllm": "vLLM CPU (eager)"}


def bench(backend: str, concurrency: int, num_prompts: int, input_len: int, output_len: int, out: Path,
          threads: int, python: str = sys.executable, reuse: bool = False) -> dict:
    if reuse:  # build the record from an earlier run's raw outputs
        result = json.loads(out.read_text())
        expected = {"backend": backend, "concurrency": concurrency, "num_prompts": num_prompts,
                    "input_len": input_len, "output_len": output_len}
        if any(result.get(k) != v for k, v in expected.items()):
            raise SystemExit(f"{out} does not hold the run {expected}")
        return result
    cmd = [python, "-m", "kernel_lab.cli", "bench", "throughput", "--backend", backend,
           "--dataset-name", "fixed", "--num-prompts", str(num_prompts), "--input-len", str(input_len),
           "--output-len", str(output_len), "--max-num-seqs", str(concurrency), "--dtype", "float32",
           "--device", "cpu", "--output-json", str(out)]
    env = {"TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads),
           **vllm_cpu_env(f"0-{threads - 1}")}
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, **env})
    return json.loads(out.read_text())


def _timing(summary: dict) -> Timing:
    ms = summary["elapsed_time"] * 1e3
    return Timing(ms, ms, ms, ms, 1, {"kind": "whole workload wall clock, one run",
                                      "requests": summary["num_requests"]})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-prompts-c1", type=int, default=8,
                        help="prompts at concurrency 1 (each runs alone, so fewer keep the run short)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads of both backends (1 keeps a shared 2-core machine predictable)")
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"),
                        help="a Python with vllm installed (project 08's environment); skipped if absent")
    parser.add_argument("--reuse-raw", action="store_true",
                        help="do not run: rebuild the record from the raw outputs of an earlier run")
    parser.add_argument("--out", default=str(REPO / "results"))
    args = parser.parse_args(argv)
    raw = Path(args.out) / "09_engine" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    backends = ["transformers"] + (["vllm"] if Path(args.vllm_python).exists() else [])
    record = ResultRecord("09_engine", "CPU throughput vs transformers generate and vLLM CPU", "cpu",
                          description=f"bundled SmolLM2-135M-Instruct, fp32, {args.input_len} prompt + "
                                      f"{args.output_len} output tokens per request (random ids, greedy, EOS "
                                      "ignored); transformers: batched generate in groups of `concurrency`, "
                                      "left-padded; vLLM: vllm-cpu LLM.generate, eager, max_num_seqs = "
                                      f"concurrency; {args.threads} intra-op thread(s) / core(s) for each")
    weight_bytes = 4 * ModelConfig.from_hf(load_config(resolve_model_dir(None))).num_parameters
    record.record["weight_bytes"] = weight_bytes
    ratios = {}
    for c in args.concurrency:
        n = args.num_prompts_c1 if c == 1 else args.num_prompts
        shape = {"concurrency": c, "num_prompts": n, "input_len": args.input_len, "output_len": args.output_len}
        ours = bench("kernel-lab", c, n, args.input_len, args.output_len, raw / f"kernel-lab-c{c}.json",
                     args.threads, reuse=args.reuse_raw)
        theirs = {b: bench(b, c, n, args.input_len, args.output_len, raw / f"{b}-c{c}.json", args.threads,
                           args.vllm_python if b == "vllm" else sys.executable, reuse=args.reuse_raw)
                  for b in backends}
        # Ceiling: each decode step reads every fp32 weight once and yields `c` tokens, so the copy bandwidth
        # bounds output tok/s by c * bandwidth / weight bytes (an upper bound: it ignores prefill and compute).
        bound_tok_s = c * record.ceilings["copy"]["GBps"] * 1e9 / weight_bytes
        ratios[c] = {b: ours["output_tokens_per_second"] / t["output_tokens_per_second"] for b, t in theirs.items()}
        record.add_case(
            f"output tok/s, concurrency {c}", shape=shape, dtype="float32", timing=_timing(ours),
            baselines={BASELINES[b]: _timing(t) for b, t in theirs.items()},
            extra={"metric": {"unit": "tok/s", "value": ours["output_tokens_per_second"]},
                   "baseline_output_tok_s": {BASELINES[b]: t["output_tokens_per_second"] for b, t in theirs.items()},
                   "ceiling": "weight-read bound: concurrency x copy GB/s / fp32 weight bytes",
                   "ceiling_tok_s": bound_tok_s,
                   "percent_of_ceiling": 100.0 * ours["output_tokens_per_second"] / bound_tok_s},
        )
        print(f"concurrency {c}: kernel-lab {ours['output_tokens_per_second']:.1f} output tok/s; " +
              "; ".join(f"{b} {t['output_tokens_per_second']:.1f} ({ratios[c][b]:.2f}x)" for b, t in theirs.items()))
    record.set_headline("output tok/s, kernel-lab / baseline: " + "; ".join(
        f"concurrency {c}: " + ", ".join(f"{r:.2f}x {b}" for b, r in rs.items()) for c, rs in ratios.items()))
    record.emit(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
