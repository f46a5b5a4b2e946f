"""Where a CPU decode step goes: the engine's whole step against its projection GEMMs alone.

    python projects/09_engine/cpu_step_floor.py [--batch 1 8 32] [--out results]

For each batch size it builds the engine on the bundled model (fp32, one intra-op thread), brings `batch`
sequences of `--input-len` random prompt tokens into steady decode, and times `LLMEngine.step()` (one
token per sequence). It then times that step's GEMMs alone, through the model's own `Linear` modules on
activations of the step's shape: every layer's qkv, o, gate_up and down projection, and the lm_head. What
is left of the step is everything else (attention, norms, RoPE, KV writes, sampling, Python).

It also times the projections of one 512-row prefill chunk, and from both bounds the throughput workload of
`cpu_throughput.py` (prompts x (input + output) tokens, `concurrency` sequences at a time): if a run did
nothing but these GEMMs, it would produce at most `workload_gemm_floor_output_tok_s` output tokens/s.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from kernel_lab.engine import SamplingParams  # noqa: E402
from kernel_lab.engine.llm_engine import LLMEngine  # noqa: E402
from kernel_lab.harness.bench import benchmark, summarize  # noqa: E402
from kernel_lab.harness.results import ResultRecord  # noqa: E402


def projection_gemms(model, rows: int, with_lm_head: bool):
    """A closure running every projection of the model on `rows` rows, and its flop count."""
    c = model.config
    g = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, c.hidden_size, generator=g)
    attn = torch.randn(rows, c.num_heads * c.head_dim, generator=g)
    inter = torch.randn(rows, c.intermediate_size, generator=g)
    calls = []
    for layer in model.layers:
        calls += [(layer.qkv_proj, hidden), (layer.o_proj, attn), (layer.gate_up_proj, hidden),
                  (layer.down_proj, inter)]
    if with_lm_head:
        calls.append((model.lm_head, hidden))
    flops = sum(2 * rows * linear.weight.numel() for linear, _ in calls)

    @torch.inference_mode()
    def run():
        for linear, x in calls:
            linear(x)
    return run, flops


def decode_step_timing(batch: int, input_len: int, steps: int, warmup: int, seed: int):
    """Timing of `steps` steady decode steps at `batch` sequences, and the engine (for its model)."""
    rng = random.Random(seed)
    engine = LLMEngine(None, dtype="float32", device="cpu", weights="float32", max_num_seqs=batch,
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
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-prompts-c1", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefill-rows", type=int, default=512, help="rows of the prefill chunk timed")
    parser.add_argument("--out", default=str(REPO / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    record = ResultRecord("09_engine", "CPU decode step vs its GEMMs", "cpu",
                          description=f"bundled SmolLM2-135M-Instruct, fp32, {args.threads} intra-op thread(s): "
                                      "the whole engine decode step against the same step's projection GEMMs "
                                      "(model's own Linear modules: MKL for 1 row, oneDNN blocked weights "
                                      "from 2 rows) and a workload bound for cpu_throughput.py. No % of "
                                      "ceiling: the harness's CPU matmul ceiling (one 1024^3 MKL matmul, "
                                      "median, on a shared machine) is below what oneDNN reaches on the "
                                      "prefill chunk, so the achieved TFLOP/s are given instead")
    prefill = None
    shares, floors = [], []
    for batch in args.batch:
        step, engine = decode_step_timing(batch, args.input_len, args.steps, warmup=3, seed=batch)
        model = engine.runner.model
        if prefill is None:
            run, prefill_flops = projection_gemms(model, args.prefill_rows, with_lm_head=False)
            prefill = benchmark(run, device="cpu", warmup=2, rep=10, cpu_max_seconds=20.0)
            record.add_case(f"prefill chunk projections, {args.prefill_rows} rows", shape={"rows": args.prefill_rows},
                            dtype="float32", timing=prefill,
                            extra={"flops": prefill_flops,
                                   "tflops": prefill_flops / (prefill.median_ms * 1e-3) / 1e12})
        run, flops = projection_gemms(model, batch, with_lm_head=True)
        gemm = benchmark(run, device="cpu", warmup=3, rep=20, cpu_max_seconds=10.0)
        prompts = args.num_prompts_c1 if batch == 1 else args.num_prompts
        # Whole workload, GEMMs only: every prompt token through a prefill chunk's projections, and
        # (prompts / batch) waves of (output_len - 1) decode steps (the first output token comes from prefill).
        floor_s = (prompts * args.input_len * prefill.median_ms / args.prefill_rows
                   + prompts / batch * (args.output_len - 1) * gemm.median_ms) / 1e3
        floor_tok_s = prompts * args.output_len / floor_s
        share = gemm.median_ms / step.median_ms
        shares.append(share)
        floors.append(floor_tok_s)
        record.add_case(
            f"decode step, batch {batch}", shape={"batch": batch, "input_len": args.input_len}, dtype="float32",
            timing=step,
            extra={"gemm_only": {"timing": gemm.to_dict(), "flops": flops,
                                 "tflops": flops / (gemm.median_ms * 1e-3) / 1e12},
                   "gemm_share_of_step": share,
                   "workload": {"concurrency": batch, "num_prompts": prompts, "input_len": args.input_len,
                                "output_len": args.output_len},
                   "workload_gemm_floor_output_tok_s": floor_tok_s})
        del engine, model
    record.set_headline("GEMM share of a decode step: " + ", ".join(
        f"batch {b}: {100 * s:.0f}%" for b, s in zip(args.batch, shares, strict=True)) +
        "; GEMM-only bound of the cpu_throughput workload: " + ", ".join(
        f"concurrency {b}: {f:.1f} output tok/s" for b, f in zip(args.batch, floors, strict=True)))
    record.emit(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
