"""Logprobs in the two OpenAI shapes, from an output delta's token ids and their engine logprobs
(`kernel_lab.engine.outputs.Logprob`, one dict per token): the legacy completion's four parallel lists and
the chat's list of content entries."""

from __future__ import annotations

import math
from collections.abc import Callable

from kernel_lab.engine.outputs import CompletionOutput

# JSON has no infinities; OpenAI reports a logprob too small to represent as this value.
LOGPROB_FLOOR = -9999.0


def finite(value: float | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    if math.isnan(value) or value < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return min(value, 0.0)


def _positions(out: CompletionOutput):
    """(token id, [(candidate id, logprob)] best first) for each token of the output."""
    entries = out.logprobs or []
    for pos, token in enumerate(out.token_ids):
        items = [(t, lp.logprob) for t, lp in entries[pos].items()] if pos < len(entries) else []
        items.sort(key=lambda kv: -kv[1])
        yield token, items


def completion_logprobs(out: CompletionOutput, text_offset: int, k: int, token_text: Callable[[int], str]) -> dict:
    """`text_offset`: where this output's text starts in the choice's text."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token, items in _positions(out):
        text = token_text(token)
        tokens.append(text)
        token_lps.append(finite(dict(items).get(token)))
        tops.append({token_text(t): finite(lp) for t, lp in items[:k]} if k else None)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(prompt_ids: list[int], entries: list | None, k: int, token_text: Callable[[int], str]) -> dict:
    """The echoed prompt's part of a completion's logprobs: the first token's logprob is null (OpenAI's
    API), every later one's comes from the engine's prompt_logprobs."""
    entries = entries or [None] * len(prompt_ids)
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for token, entry in zip(prompt_ids, entries, strict=True):
        text = token_text(token)
        items = sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda kv: -kv[1]) if entry else []
        tokens.append(text)
        token_lps.append(None if entry is None else finite(entry[token].logprob))
        tops.append(None if entry is None else {token_text(t): finite(lp) for t, lp in items[:k]} if k else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(out: CompletionOutput, k: int, token_text: Callable[[int], str]) -> list[dict]:
    def entry(token: int, logprob: float | None) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode())}

    return [entry(token, dict(items).get(token)) | {"top_logprobs": [entry(t, lp) for t, lp in items[:k]]}
            for token, items in _positions(out)]
