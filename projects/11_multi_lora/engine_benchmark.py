"""Project 11, in the engine: output tok/s with 0, 1, 4 and 8 distinct LoRA adapters in the mix, on CPU.

    python projects/11_multi_lora/engine_benchmark.py [--concurrency 8 32] [--adapters 0 1 4 8] [--reps 2]
        [--rank 16] [--input-len 64] [--output-len 64] [--threads N] [--lora-dtype auto|bfloat16] [--out results]

The bundled SmolLM2-135M-Instruct (its default quantized weights), random PEFT adapters of rank --rank on all
seven projections (kernel_lab/harness/random_lora.py). Per concurrency c, 2c requests of random prompt ids
(--input-len) and --output-len greedy tokens, EOS ignored, at most c in flight; requests are dealt
round-robin over the n adapters of a point (n = 0: all on the base model, through the LoRA-enabled engine).
The baseline is the same workload on an engine without --enable-lora, measured in the same repetition,
alternating which runs first. Figure: output tokens / wall seconds of the point; the record holds per point
the median, p20, p80 and min over repetitions of ms per output token, and each repetition's paired ratio
(base / LoRA, the two runs adjacent in time) with its median, p20 and p80, the figure the headline gives.
Our own harness: no llama.cpp tool serves several adapters in one batch (llama.cpp applies an adapter to the
whole context).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def run_point(engine, prompts, adapters, concurrency: int, output_len: int) -> tuple[float, int]:
    """Wall seconds and output tokens of the prompts, request i on adapters[i % n] (base if none)."""
    from kernel_lab.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    pending, tokens = list(enumerate(prompts)), 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(engine.requests) < concurrency:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, params, lora_request=adapters[i % len(adapters)] if adapters else None)
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return time.perf_counter() - start, tokens


def paired_ratios(base_ms: list[float], lora_ms: list[float]) -> dict:
    """Each repetition's base / LoRA ratio (its two runs are adjacent in time), and their median, p20 and p80:
    on a noisy host, slow spells then move both runs of a pair rather than one median."""
    ratios = sorted(b / a for b, a in zip(base_ms, lora_ms, strict=True))

    def at(q: float) -> float:
        return ratios[min(len(ratios) - 1, round(q * (len(ratios) - 1)))]
    return {"per_rep": [b / a for b, a in zip(base_ms, lora_ms, strict=True)], "median": at(0.5),
            "p20": at(0.2), "p80": at(0.8)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 8])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--lora-dtype", default="auto", help="the LoRA engine's slot dtype (vLLM's --lora-dtype)")
    parser.add_argument("--out", default=None, help="results directory for the record (e.g. results)")
    parser.add_argument("--note", default="", help="appended to the record's description (e.g. machine load)")
    args = parser.parse_args(argv)

    import torch

    from kernel_lab.engine import LLMEngine, LoRARequest
    from kernel_lab.harness.bench import summarize
    from kernel_lab.harness.random_lora import write_adapter
    from kernel_lab.harness.results import ResultRecord
    from kernel_lab.models.loader import load_config, resolve_model_dir

    torch.set_num_threads(args.threads)
    hf = load_config(resolve_model_dir(None, float_weights=False))
    most = max(args.adapters)
    tmp = tempfile.TemporaryDirectory()
    adapters = []
    for i in range(most):
        write_adapter(Path(tmp.name) / f"a{i}", hf, args.rank, 2 * args.rank, False, MODULES, seed=i)
        adapters.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp.name) / f"a{i}")))
    common = dict(device="cpu", max_num_seqs=max(args.concurrency), max_model_len=args.input_len + args.output_len)
    base = LLMEngine(None, **common)
    lora = LLMEngine(None, enable_lora=True, max_loras=max(most, 1), max_lora_rank=args.rank,
                     lora_dtype=args.lora_dtype, **common)
    slots = str(lora.config.lora_dtype).removeprefix("torch.")
    rng = random.Random(0)
    vocab = base.config.vocab_size
    special = set(base.tokenizer.all_special_ids)
    allowed = [t for t in range(vocab) if t not in special]
    prompts = {c: [[rng.choice(allowed) for _ in range(args.input_len)] for _ in range(2 * c)]
               for c in args.concurrency}
    for engine in (base, lora):     # warm-up (and every adapter loaded once)
        run_point(engine, prompts[args.concurrency[0]][:max(most, 1)], adapters if engine is lora else [],
                  max(most, 1), 4)

    ms = {}
    for rep in range(args.reps):
        for c in args.concurrency:
            for n in args.adapters:
                runs = [("base", base, []), ("lora", lora, adapters[:n])]
                for name, engine, mix in (runs if rep % 2 == 0 else runs[::-1]):
                    engine.block_manager.reset_prefix_cache()
                    seconds, tokens = run_point(engine, prompts[c], mix, c, args.output_len)
                    ms.setdefault((c, n, name), []).append(seconds * 1e3 / tokens)
                print(f"rep {rep} c{c} {n} adapters: {1e3 / ms[c, n, 'lora'][-1]:.1f} tok/s vs base "
                      f"{1e3 / ms[c, n, 'base'][-1]:.1f}", flush=True)

    weights = base.stats()["weights"]
    record = ResultRecord(
        "11_multi_lora", f"LoRA adapters in the mix, output tok/s ({weights} weights"
                         f"{'' if args.lora_dtype == 'auto' else f', {slots} slots'})", "cpu", ceilings_record={},
        description=f"Bundled SmolLM2-135M-Instruct, {weights} weights, random PEFT adapters of rank {args.rank} in "
                    f"{slots} slots on "
                    f"all seven projections, {args.threads} thread(s); per concurrency c, 2c requests of "
                    f"{args.input_len} random prompt ids + {args.output_len} greedy tokens (EOS ignored), "
                    "round-robin over the point's adapters; baseline: the same workload on an engine without "
                    f"--enable-lora, same run, alternating; {args.reps} repetitions. " + args.note)
    method = {"kind": "wall clock per point / output tokens", "reps": args.reps, "alternating": True}
    headline = {}
    for c in args.concurrency:
        for n in args.adapters:
            timing, baseline = summarize(ms[c, n, "lora"], method), summarize(ms[c, n, "base"], method)
            case = record.add_case(
                f"{n} adapters, concurrency {c}",
                shape={"adapters": n, "rank": args.rank, "concurrency": c, "requests": 2 * c,
                       "input_len": args.input_len, "output_len": args.output_len, "threads": args.threads},
                dtype=weights, timing=timing, baselines={"base model, no --enable-lora": baseline},
                extra={"metric": {"unit": "tok/s", "value": 1e3 / timing.median_ms},
                       "baseline_output_tok_s": 1e3 / baseline.median_ms,
                       "paired_ratios": paired_ratios(ms[c, n, "base"], ms[c, n, "lora"])})
            headline[f"c{c}_{n}_adapters_vs_base"] = case["speedup"]["base model, no --enable-lora"]
            headline[f"c{c}_{n}_adapters_paired"] = case["paired_ratios"]["median"]
    record.set_headline("output tok/s with LoRA adapters in the mix / the base model's (median over reps of "
                        "each alternating pair's ratio): " + ", ".join(
        f"{k.replace('_paired', '').replace('_', ' ')} {v:.2f}x" for k, v in headline.items() if
        k.endswith("_paired")), **headline)
    record.emit(args.out)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
