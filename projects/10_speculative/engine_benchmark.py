"""Project 10, in the engine: output tok/s with and without speculation (n-gram, or with --proposer draft the
bundled GGUF's Q4_1 blocks drafting for its float32 weights), on CPU.

    python projects/10_speculative/engine_benchmark.py [--concurrency 1 4] [--reps 3] [--threads N]
        [--max-tokens 192] [--k 4] [--weights auto|float32] [--temperature T]
        [--acceptance-method rejection_sampler|coupled] [--out results]

Three chat workloads on the bundled SmolLM2-135M-Instruct, greedy (or, with --temperature T > 0, seeded
sampling: request i has seed i), EOS honoured:
- `rewrite`: a code file in the prompt, rewritten with one change (where prompt lookup should help: the
  output copies long runs of the prompt);
- `quote`: a passage in the prompt, summarised with quotations from it;
- `chat`: the engine's short chat prompts (little in the prompt to copy: the cost of speculating for nothing).

One engine without speculation and one with `{"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": 4, "prompt_lookup_min": 1}` are loaded side by side and differ in that only. Each
repetition runs every (workload, concurrency) point on both engines, alternating which goes first, and the
point's figure is output tokens / wall seconds from the first request's arrival to the last one's finish.
A point runs max(concurrency, the workload's prompt count) requests, cycling the workload's prompts
(prefix caching on, so repeats share their prompt's blocks). The record holds per point the median, p20,
p80 and min over repetitions of ms per output token, the speculating engine's acceptance counters, and
whether both engines produced the same tokens (they must where speculation is exact token for token: greedy,
n-gram drafts, or a draft model under `coupled`; under `rejection_sampler` a sampled output is only
distributed as the target's, so the record says null there). The baseline is the same engine without
speculation; llama.cpp's lookup decoding is not run here.
Our own harness: no tool measures this engine with and without its speculation.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

CODE = '''import heapq
from dataclasses import dataclass, field


@dataclass(order=True)
class Job:
    priority: int
    name: str = field(compare=False)
    attempts: int = field(default=0, compare=False)


class JobQueue:
    def __init__(self, max_attempts: int = 3):
        self.heap: list[Job] = []
        self.max_attempts = max_attempts

    def push(self, name: str, priority: int) -> None:
        heapq.heappush(self.heap, Job(priority, name))

    def pop(self) -> Job | None:
        if not self.heap:
            return None
        return heapq.heappop(self.heap)

    def retry(self, job: Job) -> bool:
        job.attempts += 1
        if job.attempts >= self.max_attempts:
            return False
        heapq.heappush(self.heap, job)
        return True

    def __len__(self) -> int:
        return len(self.heap)
'''

PASSAGE = ("The lighthouse on the northern cape was built in 1871 from granite quarried on the island itself. "
           "For ninety years its keepers climbed one hundred and twelve steps each evening to light the lamp. "
           "\"The sea does not forgive a dark night,\" wrote the first keeper in his log. In 1962 the lamp was "
           "electrified and the last keeper left, but the villagers still climb the tower every midsummer. "
           "\"We go up to remember that someone once kept watch for us,\" one of them told a visiting reporter.")

WORKLOADS = {
    "rewrite": [f"Here is a Python file:\n\n```python\n{CODE}```\n\nPrint the file again with one change: "
                f"rename {old} to {new}. Keep every other line identical."
                for old, new in (("the method `retry`", "`requeue`"), ("the attribute `heap`", "`items`"))],
    "quote": ["Summarise this passage in three sentences, quoting its two quotations exactly.\n\n" + PASSAGE,
              "Retell this passage for a child, keeping the keepers' words as quotes.\n\n" + PASSAGE],
}


def workloads() -> dict[str, list[str]]:
    from kernel_lab.bench.kv_page_agreement import CHAT_PROMPTS
    return {**WORKLOADS, "chat": CHAT_PROMPTS[:4]}


def point_prompts(prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """At least `concurrency` prompts, the workload's cycled (repeats share their prompt's cached blocks)."""
    return [prompts[i % len(prompts)] for i in range(max(concurrency, len(prompts)))]


def run_point(engine, prompts: list[list[int]], concurrency: int, max_tokens: int,
              temperature: float = 0.0) -> tuple[float, int, list]:
    """Wall seconds and output tokens for the prompts, at most `concurrency` in flight; the token lists.
    temperature > 0: request i samples with seed i."""
    from kernel_lab.engine import SamplingParams

    pending, outputs, tokens = list(enumerate(prompts)), {}, 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(engine.requests) < concurrency:
            i, prompt = pending.pop(0)
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                    seed=i if temperature > 0 else None)
            engine.add_request(str(i), prompt, params)
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id)] = list(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    tokens = sum(len(t) for t in outputs.values())
    return seconds, tokens, [outputs[i] for i in range(len(prompts))]


WHAT = {"ngram": "n-gram speculation (prompt lookup 1..4)",
        "draft": "draft-model speculation (the bundled Q4_1 GGUF drafting for its float32 weights)"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="speculative_config.disable_by_batch_size (default: unset, as vLLM's)")
    parser.add_argument("--weights", default="auto", help="the engine's --weights (auto: the bundled GGUF)")
    parser.add_argument("--proposer", choices=("ngram", "draft"), default="ngram",
                        help="ngram: prompt lookup; draft: the bundled GGUF's Q4_1 blocks drafting for the same "
                             "model's float32 weights (sets --weights float32 for the target)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; > 0: seeded sampling (request i has seed i)")
    parser.add_argument("--acceptance-method", choices=("rejection_sampler", "coupled"), default="rejection_sampler",
                        help="speculative_config.acceptance_method (the draft proposer's rule)")
    parser.add_argument("--out", default=None, help="results directory for the record (e.g. results)")
    parser.add_argument("--note", default="", help="appended to the record's description (e.g. machine load)")
    args = parser.parse_args(argv)

    import torch

    from kernel_lab.engine import LLMEngine
    from kernel_lab.harness.bench import summarize
    from kernel_lab.harness.results import ResultRecord

    torch.set_num_threads(args.threads)
    name = args.proposer
    if name == "ngram":
        spec_config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 1, "disable_by_batch_size": args.disable_by_batch_size}
    else:
        from kernel_lab.models.gguf import default_model_path

        args.weights = "float32"
        spec_config = {"model": str(default_model_path()), "num_speculative_tokens": args.k, "weights": "quantized",
                       "disable_by_batch_size": args.disable_by_batch_size,
                       "acceptance_method": args.acceptance_method}
    exact = args.temperature == 0 or name == "ngram" or args.acceptance_method == "coupled"
    common = dict(device="cpu", weights=args.weights, max_num_seqs=max(args.concurrency))
    engines = {"base": LLMEngine(None, **common), name: LLMEngine(None, speculative_config=spec_config, **common)}
    tokenizer = engines["base"].tokenizer
    prompts = {name: [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in texts]
               for name, texts in workloads().items()}
    points = [(w, c) for w in prompts for c in args.concurrency]
    for engine in engines.values():         # warm-up: one short request each
        run_point(engine, prompts["chat"][:1], 1, 8)

    ms_per_token = {(p, e): [] for p in points for e in engines}
    same = {p: True for p in points}
    counters = {}
    for rep in range(args.reps):
        for p in points:
            order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
            tokens_of = {}
            for engine_name in order:
                engine = engines[engine_name]
                before = engine.speculator.counters() if engine_name != "base" else None
                seconds, n, tokens_of[engine_name] = run_point(engine, point_prompts(prompts[p[0]], p[1]), p[1],
                                                               args.max_tokens, args.temperature)
                ms_per_token[p, engine_name].append(seconds * 1e3 / n)
                if before is not None:
                    after = engine.speculator.counters()
                    c = counters.setdefault(p, {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0})
                    for key in c:
                        c[key] += after[key] - before[key]
                if engine_name != "base":
                    tokens_of["spec"] = tokens_of.pop(engine_name)
            same[p] = same[p] and tokens_of["base"] == tokens_of["spec"] if exact else None
            print(f"rep {rep} {p[0]} c{p[1]}: base {1e3 / ms_per_token[p, 'base'][-1]:.1f} tok/s, {name} "
                  f"{1e3 / ms_per_token[p, name][-1]:.1f} tok/s, same tokens {same[p]}", flush=True)

    stats = engines["base"].stats()
    record = ResultRecord(
        "10_speculative", f"{WHAT[name]} in the engine, output tok/s ({stats['weights']} weights)"
        + (f", sampled at temperature {args.temperature:g}"
           + (f", {args.acceptance_method}" if name == "draft" else "") if args.temperature > 0 else ""), "cpu",
        ceilings_record={},
        description=f"Bundled SmolLM2-135M-Instruct, {stats['weights']} weights, "
                    + (f"seeded sampling at temperature {args.temperature:g} (request i: seed i), acceptance "
                       f"{args.acceptance_method if name == 'draft' else 'n-gram (one-hot q)'}, "
                       if args.temperature > 0 else "greedy, ") + f"up to {args.max_tokens} "
                    f"output tokens, {args.threads} thread(s); {WHAT[name]} k={args.k}, adaptive "
                    f"draft length, disable_by_batch_size {args.disable_by_batch_size}; workloads rewrite (code in "
                    "the prompt), quote (passage in the prompt), chat; "
                    f"{args.reps} alternating repetitions per point. Metric: ms per output token over a point's "
                    "wall clock. Baseline: the same engine without speculation, same run. " + args.note)
    method = {"kind": "wall clock per point / output tokens", "reps": args.reps, "alternating": True}
    headline = {}
    for p in points:
        spec, base = (summarize(ms_per_token[p, e], method) for e in (name, "base"))
        c = counters[p]
        acceptance = c["num_accepted_tokens"] / c["num_draft_tokens"] if c["num_draft_tokens"] else None
        case = record.add_case(
            f"{p[0]}, concurrency {p[1]}",
            shape={"workload": p[0], "concurrency": p[1], "prompts": len(point_prompts(prompts[p[0]], p[1])),
                                               "max_tokens": args.max_tokens, "threads": args.threads},
            dtype=stats["weights"], timing=spec, baselines={"no speculation": base},
            extra={"metric": {"unit": "tok/s", "value": 1e3 / spec.median_ms},
                   "baseline_output_tok_s": 1e3 / base.median_ms, "spec_decode": c, "acceptance_rate": acceptance,
                   "same_tokens_as_baseline": same[p]})
        headline[f"{p[0]}_c{p[1]}_speedup"] = case["speedup"]["no speculation"]
        print(f"{p[0]} c{p[1]}: {case['speedup']['no speculation']:.2f}x, acceptance {acceptance}")
    if exact:
        record.set_correctness(sum(same.values()), len(same))
    record.set_headline(f"{WHAT[name]} vs none: " + ", ".join(f"{k.replace('_speedup', '')} {v:.2f}x"
                                                                 for k, v in headline.items()), **headline)
    record.emit(args.out)
    return 0 if not exact or all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
