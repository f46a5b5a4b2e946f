"""Greedy agreement of the engine with llama.cpp on the same GGUF: do both write the same tokens?

    python projects/09_engine/llama_cpp_agreement.py [--num-prompts 16] [--max-tokens 64] [--weights auto]
        [--llama-cpp-python .venv-llamacpp/bin/python] [--out results]

Both run the bundled SmolLM2-135M-Instruct GGUF (or --model, a .gguf file) on the same token ids: chat
prompts rendered by the engine's chat template, greedy, `max_tokens` tokens each with EOS ignored, every
prompt in one batch (continuous batching in both). The engine runs with its defaults (weights=auto: the
GGUF's quantized blocks on CPU); llama.cpp runs kernel_lab/bench/llama_cpp.py in its own environment
(`make llama-cpp-env`). Each pair of outputs is cut after its first EOS token (what a chat would show), then
compared: a sequence agrees when both are identical; the prefix fraction is the length of the common prefix
over the longer of the two. The record carries both rates, every pair's first divergence, and passes/total
as the exact-match count.

For scale, the engine's float32-weight path runs too: its agreement with llama.cpp and with the default
path are in the record beside the headline.

The two are not expected to agree everywhere: llama.cpp quantizes activations to 8 bits per block for its
dot products and keeps an f16 KV cache, the engine computes in float32 activations, so near-ties in the
logits can break either way; after the first divergence the continuations differ.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kernel_lab.bench.throughput import DEFAULT_LLAMA_CPP_PYTHON, gguf_path, run_llama_cpp  # noqa: E402
from kernel_lab.chat import DEMO_PROMPTS  # noqa: E402

MORE_PROMPTS = [
    "How many legs does a spider have?",
    "Write one sentence about the ocean.",
    "What is 12 times 7?",
    "Name three planets in our solar system.",
    "Why is the sky blue? Answer briefly.",
    "Give a synonym for 'happy'.",
    "What does a compiler do?",
    "Describe a sunset in one sentence.",
]
CHAT_PROMPTS = DEMO_PROMPTS + MORE_PROMPTS


def cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def compare(ours: list[int], theirs: list[int]) -> dict:
    common = 0
    for a, b in zip(ours, theirs):
        if a != b:
            break
        common += 1
    longest = max(len(ours), len(theirs), 1)
    return {"exact": ours == theirs, "common_prefix": common, "prefix_fraction": common / longest,
            "first_divergence": None if ours == theirs else common, "ours_len": len(ours), "theirs_len": len(theirs)}


def engine_greedy(model, prompts: list[list[int]], max_tokens: int, weights: str, threads: int | None):
    import torch

    from kernel_lab.engine import LLMEngine, SamplingParams

    if threads:
        torch.set_num_threads(threads)
    engine = LLMEngine(model, device="cpu", weights=weights, max_num_seqs=len(prompts))
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    outputs: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id)] = list(out.outputs[0].token_ids)
    return [outputs[i] for i in range(len(prompts))], time.perf_counter() - start, engine


def llama_cpp_outputs(python: Path, model: Path, prompts, max_tokens: int, concurrency: int, threads: int) -> dict:
    return run_llama_cpp(python, {"model": str(model), "prompts": prompts, "output_len": max_tokens,
                                  "concurrency": concurrency, "threads": threads, "warmup": False})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--weights", default="auto", help="the engine's weights: auto | quantized | float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--llama-cpp-python", default=str(DEFAULT_LLAMA_CPP_PYTHON))
    parser.add_argument("--out", default=None, help="results directory for the record (e.g. results)")
    args = parser.parse_args(argv)
    python = Path(args.llama_cpp_python)
    if not python.exists():
        raise SystemExit(f"no llama.cpp Python at {python}: `make llama-cpp-env` builds it")
    model = gguf_path(args.model)

    from kernel_lab.harness.bench import Timing
    from kernel_lab.harness.results import ResultRecord

    messages = [[{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}] for i in range(args.num_prompts)]
    # Tokenise with the engine's own tokenizer and chat template, then run both on those ids.
    from kernel_lab.models.loader import resolve_model_dir
    from kernel_lab.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_directory(resolve_model_dir(str(model)))
    prompts_engine = [tokenizer.apply_chat_template(m) for m in messages]
    ours, ours_s, engine = engine_greedy(str(model), prompts_engine, args.max_tokens, args.weights, args.threads)
    theirs_run = llama_cpp_outputs(python, model, prompts_engine, args.max_tokens, len(prompts_engine), args.threads)
    theirs = theirs_run["outputs"]
    eos = set(tokenizer.eos_token_ids)

    def agreement(xs, ys):
        pairs = [compare(cut_at_eos(a, eos), cut_at_eos(b, eos)) for a, b in zip(xs, ys, strict=True)]
        return pairs, sum(p["exact"] for p in pairs), sum(p["prefix_fraction"] for p in pairs) / len(pairs)

    pairs, exact, mean_prefix = agreement(ours, theirs)
    context = {}
    if engine.stats()["weights"] != "float32":
        fp32, _, _ = engine_greedy(str(model), prompts_engine, args.max_tokens, "float32", args.threads)
        for name, (xs, ys) in {"float32_weights_vs_llama_cpp": (fp32, theirs),
                               "default_vs_float32_weights": (ours, fp32)}.items():
            _, e, m = agreement(xs, ys)
            context[name] = {"exact": e, "total": len(pairs), "mean_prefix_fraction": m}
            print(f"{name}: {e}/{len(pairs)} identical, mean prefix fraction {m:.3f}")
    for i, (p, a, b) in enumerate(zip(pairs, ours, theirs)):
        mark = "=" if p["exact"] else f"diverges at token {p['first_divergence']}"
        print(f"[{i:2d}] {mark}\n     engine:    {tokenizer.decode(cut_at_eos(a, eos))!r}\n"
              f"     llama.cpp: {tokenizer.decode(cut_at_eos(b, eos))!r}")
    stats = engine.stats()
    print(f"exact-match sequences: {exact}/{len(pairs)}; mean fraction of tokens before the first divergence: "
          f"{mean_prefix:.3f} (engine weights={stats['weights']}, llama.cpp {theirs_run['llama_cpp_python']})")
    if args.out is None:
        return 0
    record = ResultRecord("09_engine", "Greedy agreement with llama.cpp on the same GGUF", "cpu",
                          description=f"{len(pairs)} chat prompts (the engine's chat template), {args.max_tokens} "
                                      "greedy tokens each with EOS ignored, both cut after their first EOS; "
                                      f"engine weights={stats['weights']} (float32 activations), llama.cpp "
                                      f"{theirs_run['llama_cpp_python']} on the GGUF as stored; all prompts in "
                                      f"one batch in both; {args.threads} thread(s)")
    ms = ours_s * 1e3
    llama_ms = theirs_run["elapsed_time"] * 1e3
    record.add_case(
        f"greedy agreement, {len(pairs)} chat prompts x {args.max_tokens} tokens",
        shape={"num_prompts": len(pairs), "max_tokens": args.max_tokens, "threads": args.threads},
        dtype="float32", timing=Timing(ms, ms, ms, ms, 1, {"kind": "engine generation wall clock, one run"}),
        extra={"metric": {"unit": "ms", "value": ms}, "exact_match_rate": exact / len(pairs),
               "mean_prefix_fraction": mean_prefix, "pairs": pairs, "engine_weights": stats["weights"],
               "llama_cpp_ms": llama_ms, "for_scale": context,
               "llama_cpp": {"version": theirs_run["llama_cpp_python"], "system_info": theirs_run["system_info"],
                             "gguf": str(model)}},
    )
    record.set_correctness(exact, len(pairs))
    record.set_headline(f"greedy agreement with llama.cpp: {exact}/{len(pairs)} sequences identical, "
                        f"{100 * mean_prefix:.1f}% of tokens before the first divergence on average",
                        exact_match_rate=exact / len(pairs), mean_prefix_fraction=mean_prefix)
    record.emit(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
