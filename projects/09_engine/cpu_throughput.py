"""CPU throughput of the engine against transformers' batched `generate`, on the same workload.

    python projects/09_engine/cpu_throughput.py [--concurrency 1 8 32] [--num-prompts 32] [--out results]

For each concurrency it runs `kernel-lab bench throughput` twice in fresh processes, once per backend,
on the same fixed-length workload (random token ids, greedy, EOS ignored, fp32), and keeps both raw
JSON outputs under <out>/09_engine/raw/. It then writes one result record with a case per concurrency:
our output tok/s, with transformers' wall time on the same workload as the baseline (so `speedup` is the
throughput ratio). Long: minutes per point on a 2-core CPU, dominated by concurrency 1.
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

from kernel_lab.harness.bench import Timing  # noqa: E402
from kernel_lab.harness.results import ResultRecord  # noqa: E402


def bench(backend: str, concurrency: int, num_prompts: int, input_len: int, output_len: int, out: Path,
          threads: int) -> dict:
    cmd = [sys.executable, "-m", "kernel_lab.cli", "bench", "throughput", "--backend", backend,
           "--dataset-name", "fixed", "--num-prompts", str(num_prompts), "--input-len", str(input_len),
           "--output-len", str(output_len), "--max-num-seqs", str(concurrency), "--dtype", "float32",
           "--device", "cpu", "--output-json", str(out)]
    env = {"TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
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
    parser.add_argument("--out", default=str(REPO / "results"))
    args = parser.parse_args(argv)
    raw = Path(args.out) / "09_engine" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    record = ResultRecord("09_engine", "CPU throughput vs transformers generate", "cpu",
                          description=f"bundled SmolLM2-135M-Instruct, fp32, {args.input_len} prompt + "
                                      f"{args.output_len} output tokens per request (random ids, greedy, EOS "
                                      "ignored); transformers: batched generate in groups of `concurrency`, "
                                      f"left-padded; {args.threads} intra-op thread(s) for both")
    ratios = {}
    for c in args.concurrency:
        n = args.num_prompts_c1 if c == 1 else args.num_prompts
        ours = bench("kernel-lab", c, n, args.input_len, args.output_len, raw / f"kernel-lab-c{c}.json",
                     args.threads)
        theirs = bench("transformers", c, n, args.input_len, args.output_len, raw / f"transformers-c{c}.json",
                       args.threads)
        ratios[c] = ours["output_tokens_per_second"] / theirs["output_tokens_per_second"]
        record.add_case(
            f"output tok/s, concurrency {c}", shape={"concurrency": c, "num_prompts": n,
                                                     "input_len": args.input_len, "output_len": args.output_len},
            dtype="float32", timing=_timing(ours), baselines={"transformers generate": _timing(theirs)},
            extra={"metric": {"unit": "tok/s", "value": ours["output_tokens_per_second"]},
                   "transformers_output_tok_s": theirs["output_tokens_per_second"],
                   "percent_of_ceiling": None, "ceiling": None},
        )
        print(f"concurrency {c}: {ours['output_tokens_per_second']:.1f} vs "
              f"{theirs['output_tokens_per_second']:.1f} output tok/s ({ratios[c]:.2f}x)")
    record.set_headline("output tok/s vs transformers generate: " +
                        ", ".join(f"{r:.2f}x at concurrency {c}" for c, r in ratios.items()))
    record.emit(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
