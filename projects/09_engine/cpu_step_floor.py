"""Where a CPU decode step goes: the engine's whole step against its projections alone.

    python projects/09_engine/cpu_step_floor.py [--model FILE.gguf] [--batch 1 8 32] [--weights quantized float32]
                                                [--threads 1 2] [--out results]

For each weight layout (`--weights`: the GGUF's quantized blocks, the engine's CPU default, and float32),
thread count and batch size it builds the engine on the bundled model or `--model` (float32 activations), brings
`batch` sequences of `--input-len` random prompt tokens into steady decode, and times `LLMEngine.step()` (one
token per sequence). It then times that step's projections alone, through the model's own layers on
activations of the step's shape (every layer's qkv, o, gate_up and down projection, and the lm_head; with
quantized weights inside `kernel_threads`, as the step runs them). What is left of the step is everything
else: attention with RoPE and the KV write, norms, the activation, sampling, scheduling and Python.

It also times the projections of one 512-row prefill chunk, and from both bounds the throughput workload of
`cpu_throughput.py` (prompts x (input + output) tokens, `concurrency` sequences at a time): if a run did
nothing but these projections, it would produce at most `workload_gemm_floor_output_tok_s` output tokens/s.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from kernel_lab.engine import SamplingParams  # noqa: E402
from kernel_lab.engine.llm_engine import LLMEngine  # noqa: E402
from kernel_lab.harness.bench import benchmark, summarize  # noqa: E402
from kernel_lab.harness.results import ResultRecord  # noqa: E402
from kernel_lab.models.layers.linear import QuantizedLinear  # noqa: E402
from kernel_lab.ops.gguf_linear import kernel_threads  # noqa: E402


def projection_shape(linear) -> tuple[int, int]:
    """(out_features, in_features) of a float32 `Linear` or a `QuantizedLinear`."""
    return tuple(linear.packed.shape) if isinstance(linear, QuantizedLinear) else tuple(linear.weight.shape)


def projection_gemms(model, rows: int, with_lm_head: bool):
    """A closure running every projection of the model on `rows` rows, and its flop count."""
    c = model.config
    g = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, c.hidden_size, generator=g)
    attn = torch.randn(rows, c.num_heads * c.head_dim, generator=g)
    inter = torch.randn(rows, c.intermediate_size, generator=g)
    calls = []
    for layer in model.layers:
        calls += [(layer.qkv_proj, hidden), (layer.o_proj, attn), (layer.mlp.gate_up_proj, hidden),
                  (layer.mlp.down_proj, inter)]
    if with_lm_head:
        calls.append((model.lm_head, hidden))
    flops = sum(2 * rows * math.prod(projection_shape(linear)) for linear, _ in calls)
    quantized = any(isinstance(linear, QuantizedLinear) for linear, _ in calls)

    @torch.inference_mode()
    def run():
        with kernel_threads(torch.get_num_threads()) if quantized else nullcontext():
            for linear, x in calls:
                linear(x)
    return run, flops


def decode_step_timing(batch: int, input_len: int, steps: int, warmup: int, seed: int, weights: str,
                       model: str | None = None):
    """Timing of `steps` steady decode steps at `batch` sequences, and the engine (for its model)."""
    rng = random.Random(seed)
    engine = LLMEngine(model, dtype="float32", device="cpu", weights=weights, max_num_seqs=batch,
                       enable_prefix_caching=False,
                       max_model_len=input_len + warmup + steps + 8)
    params = SamplingParams(temperature=0, max_tokens=warmup + steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(1000, 40000) for _ in range(input_len)], params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()  # prefill (chunked under the token budget)
    for _ in range(warmup):
        engine.step()
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        samples.append((time.perf_counter() - t0) * 1e3)
    return summarize(samples, {"timer": "time.perf_counter (CPU wall clock)", "device": "cpu", "warmup": warmup,
                               "what": "LLMEngine.step(), every sequence decoding one token",
                               "context_tokens": f"{input_len + warmup} to {input_len + warmup + steps}"}), engine


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--weights", nargs="+", choices=["quantized", "float32"], default=["quantized", "float32"])
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1 and all cores")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-prompts-c1", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30, help="steady decode steps timed per point")
    parser.add_argument("--prefill-rows", type=int, default=512, help="rows of the prefill chunk timed")
    parser.add_argument("--out", default=str(REPO / "results"))
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    threads_list = args.threads or sorted({1, cores})

    label = "bundled SmolLM2-135M-Instruct" if args.model is None else \
        f"{Path(args.model).parent.name} {Path(args.model).stem}"
    record = ResultRecord("09_engine", "CPU decode step vs its GEMMs" + ("" if args.model is None else f" on {label}"),
                          "cpu",
                          description=f"{label}, float32 activations, the engine's weight "
                                      "layouts: quantized (the GGUF's blocks through gguf_linear, the "
                                      "CPU default) and float32 (MKL for 1 row, oneDNN blocked weights from 2 "
                                      "rows); the whole engine decode step against the same step's projections "
                                      "run alone through the model's own layers, and a workload bound for "
                                      "cpu_throughput.py. No % of ceiling: the share of the step is the point, "
                                      "and the achieved TFLOP/s are given")
    headline = []
    for weights in args.weights:
        for threads in threads_list:
            torch.set_num_threads(threads)
            prefill = None
            shares, floors = [], []
            for batch in args.batch:
                step, engine = decode_step_timing(batch, args.input_len, args.steps, warmup=3, seed=batch,
                                                  weights=weights, model=args.model)
                model = engine.runner.model
                label = f"{weights} weights, {threads} thread{'s' if threads > 1 else ''}"
                shape = {"weights": weights, "threads": threads}
                if prefill is None:
                    run, prefill_flops = projection_gemms(model, args.prefill_rows, with_lm_head=False)
                    prefill = benchmark(run, device="cpu", warmup=2, rep=10, cpu_max_seconds=20.0)
                    record.add_case(f"prefill chunk projections, {args.prefill_rows} rows, {label}",
                                    shape={**shape, "rows": args.prefill_rows}, dtype="float32", timing=prefill,
                                    extra={"flops": prefill_flops,
                                           "tflops": prefill_flops / (prefill.median_ms * 1e-3) / 1e12})
                run, flops = projection_gemms(model, batch, with_lm_head=True)
                gemm = benchmark(run, device="cpu", warmup=3, rep=20, cpu_max_seconds=10.0)
                prompts = args.num_prompts_c1 if batch == 1 else args.num_prompts
                # Whole workload, projections only: every prompt token through a prefill chunk's projections,
                # and (prompts / batch) waves of (output_len - 1) decode steps (the first output token comes
                # from prefill).
                floor_s = (prompts * args.input_len * prefill.median_ms / args.prefill_rows
                           + prompts / batch * (args.output_len - 1) * gemm.median_ms) / 1e3
                floor_tok_s = prompts * args.output_len / floor_s
                share = gemm.median_ms / step.median_ms
                shares.append(share)
                floors.append(floor_tok_s)
                record.add_case(
                    f"decode step, batch {batch}, {label}",
                    shape={**shape, "batch": batch, "input_len": args.input_len}, dtype="float32", timing=step,
                    extra={"gemm_only": {"timing": gemm.to_dict(), "flops": flops,
                                         "tflops": flops / (gemm.median_ms * 1e-3) / 1e12,
                                         "weight_bytes": model.decode_weight_bytes(),
                                         "weight_GBps": model.decode_weight_bytes() / (gemm.median_ms * 1e-3) / 1e9},
                           "gemm_share_of_step": share,
                           "workload": {"concurrency": batch, "num_prompts": prompts, "input_len": args.input_len,
                                        "output_len": args.output_len},
                           "workload_gemm_floor_output_tok_s": floor_tok_s})
                del engine, model
            headline.append(f"{weights}, {threads} thread(s): projection share of a decode step " + ", ".join(
                f"batch {b}: {100 * s:.0f}%" for b, s in zip(args.batch, shares, strict=True)))
    record.set_headline("; ".join(headline))
    record.emit(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
