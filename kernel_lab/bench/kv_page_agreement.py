"""How far narrow (16-bit, int8, fp8) KV pages move the bundled model from float32 pages on CPU (issue 35).

For each page format the same chat prompts run greedily (EOS ignored, all in one batch) on an engine that
differs from the float32-page engine in `kv_cache_dtype` only. Two measures against float32 pages:
- the first generated token's log-probabilities of float32's top 5 tokens: the largest absolute change
  (a token that leaves the format's top `LOGPROB_TOP` counts as an infinite change);
- greedy agreement: how many prompts produce the identical token sequence, and where the others diverge.

Used by projects/09_engine/kv_page_agreement.py (the committed record) and test_kv_cache_dtype.py.
"""

from __future__ import annotations

import math
import time

from kernel_lab.chat import DEMO_PROMPTS

MORE_CHAT_PROMPTS = [
    "List four animals that live in the Arctic.",
    "What is the boiling point of water in Fahrenheit?",
    "Write two lines of a poem about autumn leaves.",
    "Explain what a linked list is in one sentence.",
    "What year did the Second World War end?",
    "Recommend a book for someone who likes science fiction.",
    "How do you say 'thank you' in Japanese?",
    "Summarise the plot of Cinderella in one sentence.",
]
CHAT_PROMPTS = DEMO_PROMPTS + MORE_CHAT_PROMPTS
LOGPROB_TOP = 20   # each format reports its top 20, so float32's top 5 are found unless they moved far
COMPARED_TOP = 5


def greedy_run(kv_cache_dtype: str, prompts: list[list[int]], max_tokens: int, prompt_through_sdpa: bool = False,
               logprobs: int | None = LOGPROB_TOP, **engine_kwargs):
    """(token lists, first-token {token id: logprob} dicts, seconds, engine stats) of one engine.

    `logprobs=None`: tokens only (no first-token dicts), for a run whose log-probabilities are not compared:
    every step's top-`logprobs` costs far more than the step under the Triton interpreter that tests run.

    `prompt_through_sdpa`: the control run. Prompt tokens attend through SDPA (the non-CPU path) instead of
    one decode-kernel call per row, which changes the prompt's attention by float32 rounding only: what
    agreement that leaves shows how much of a format's disagreement any ulp-level change would cause."""
    from kernel_lab.engine import LLMEngine, SamplingParams

    engine = LLMEngine(None, device="cpu", kv_cache_dtype=kv_cache_dtype, max_num_seqs=len(prompts),
                       **engine_kwargs)
    if prompt_through_sdpa:
        engine.runner.prompt_tokens_decode = False
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[int(out.request_id)] = out.outputs[0]
    seconds = time.perf_counter() - start
    outputs = [finished[i] for i in range(len(prompts))]
    first = [] if logprobs is None else [{t: entry.logprob for t, entry in out.logprobs[0].items()}
                                         for out in outputs]
    return [list(out.token_ids) for out in outputs], first, seconds, engine.stats()


def first_divergence(ours: list[int], reference: list[int]) -> int | None:
    """The first position where the two differ (None: identical)."""
    for i, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            return i
    return None if len(ours) == len(reference) else min(len(ours), len(reference))


def top_logprob_shift(ours: dict[int, float], reference: dict[int, float]) -> float:
    """The largest |logprob change| over the reference's COMPARED_TOP most likely tokens."""
    top = sorted(reference, key=reference.get, reverse=True)[:COMPARED_TOP]
    return max(abs(ours[t] - reference[t]) if t in ours else math.inf for t in top)


def compare(tokens, first, reference_tokens, reference_first) -> dict:
    divergences = [first_divergence(a, b) for a, b in zip(tokens, reference_tokens, strict=True)]
    shifts = [top_logprob_shift(a, b) for a, b in zip(first, reference_first, strict=True)]
    return {"identical": sum(d is None for d in divergences), "total": len(divergences),
            "first_divergences": divergences, "max_top5_first_logprob_shift": max(shifts),
            "top5_first_logprob_shifts": shifts}
