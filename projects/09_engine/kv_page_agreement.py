"""Greedy agreement and first-token log-probabilities of narrow KV pages against float32 pages, on CPU.

    python projects/09_engine/kv_page_agreement.py [--max-tokens 64] [--threads N] [--out results]

16 chat prompts (the engine's chat template) run greedily for --max-tokens tokens, EOS ignored, all in one
batch, on the bundled SmolLM2-135M-Instruct once per page format (float32, float16, bfloat16, int8, fp8) and weight
path: float32 weights (the pages' own effect) and the default quantized GGUF weights, whose int8
activations turn any small change of their input into a different rounding and so amplify it (as they do
for the SDPA-vs-kernel difference, engine/model_runner.py). Engines differ in kv_cache_dtype only. A
control per weight path runs float32 pages with the prompt's attention through SDPA (a float32-rounding
change only), to show how much disagreement any ulp-level change causes there.
The record (an accuracy record: its times are one run's wall clock, for scale only) holds each format's
identical-sequence count, every prompt's first divergence, the largest first-token log-probability change
over float32's top 5, the machine and the C kernel's ISA path.
What is measured: kernel_lab/bench/kv_page_agreement.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kernel_lab.bench.kv_page_agreement import CHAT_PROMPTS, compare, greedy_run  # noqa: E402

FORMATS = ("float16", "bfloat16", "int8", "fp8")
WEIGHTS = ("float32", "auto")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=None, help="results directory for the record (e.g. results)")
    args = parser.parse_args(argv)

    import torch

    from kernel_lab.harness.bench import Timing
    from kernel_lab.harness.results import ResultRecord
    from kernel_lab.models.loader import resolve_model_dir
    from kernel_lab.models.tokenizer import Tokenizer
    from kernel_lab.ops import cpu_kernels

    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_directory(resolve_model_dir(None))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    library = cpu_kernels.load_library()
    isa = library.kl_paged_attention_isa().decode() if library is not None else "none (PyTorch reference)"
    record = ResultRecord("09_engine", "Greedy agreement of narrow KV pages with float32 pages", "cpu",
                          ceilings_record={},
                          description=f"{len(prompts)} chat prompts x {args.max_tokens} greedy tokens (EOS "
                                      "ignored, one batch) on the bundled SmolLM2-135M-Instruct, float32 "
                                      "activations, float32 and the default (quantized) weights; each format "
                                      f"against float32 pages on the same weights; C kernel ISA path {isa}; "
                                      f"{args.threads} thread(s). An accuracy record: times are one run's wall "
                                      "clock, for scale only.")
    summaries = {}
    for weights in WEIGHTS:
        reference_tokens, reference_first, reference_s, stats = greedy_run("float32", prompts, args.max_tokens,
                                                                           weights=weights)
        control_tokens, control_first, _, _ = greedy_run("float32", prompts, args.max_tokens, weights=weights,
                                                         prompt_through_sdpa=True)
        control = compare(control_tokens, control_first, reference_tokens, reference_first)
        print(f"{stats['weights']} weights, control (float32 pages, prompt through SDPA): {control['identical']}/"
              f"{control['total']} identical, top-5 first-token logprob change "
              f"{control['max_top5_first_logprob_shift']:.2e}")
        for name in FORMATS:
            tokens, first, seconds, _ = greedy_run(name, prompts, args.max_tokens, weights=weights)
            summary = summaries[stats["weights"], name] = compare(tokens, first, reference_tokens, reference_first)
            print(f"{stats['weights']} weights, {name}: {summary['identical']}/{summary['total']} identical, first "
                  f"divergences {summary['first_divergences']}, largest top-5 first-token logprob change "
                  f"{summary['max_top5_first_logprob_shift']:.2e}")
            ms = seconds * 1e3
            record.add_case(f"{name} pages vs float32 pages, {stats['weights']} weights, {len(prompts)} prompts x "
                            f"{args.max_tokens} tokens",
                            shape={"num_prompts": len(prompts), "max_tokens": args.max_tokens,
                                   "threads": args.threads},
                            dtype=name, timing=Timing(ms, ms, ms, ms, 1, {"kind": "generation wall clock, one run"}),
                            extra={"metric": {"unit": "ms", "value": ms}, "kv_cache_dtype": name, "isa": isa,
                                   "engine_weights": stats["weights"], "float32_pages_ms": reference_s * 1e3,
                                   "control_float32_pages_prompt_through_sdpa": control, **summary})
    identical = sum(s["identical"] for s in summaries.values())
    total = sum(s["total"] for s in summaries.values())
    record.set_correctness(identical, total)
    record.set_headline("greedy agreement with float32 pages: " + ", ".join(
        f"{name} on {weights} weights {s['identical']}/{s['total']} (first-token top-5 logprobs move <= "
        f"{s['max_top5_first_logprob_shift']:.1e})" for (weights, name), s in summaries.items()),
        **{f"{name}_{weights}_weights_identical": s["identical"] for (weights, name), s in summaries.items()})
    record.emit(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
