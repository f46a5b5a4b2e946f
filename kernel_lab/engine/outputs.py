"""What the engine returns: RequestOutput and CompletionOutput (vLLM's shapes, plus streaming deltas)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int                       # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """`text`, `token_ids` and `logprobs` are cumulative, or only this output's new part when the request
    asked for RequestOutputKind.DELTA (then they are the same objects as `new_text` / `new_token_ids`)."""

    index: int                                  # which of the request's n completions
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None   # one dict per token of token_ids, when requested
    finish_reason: str | None = None            # None (running), "stop" or "length"
    stop_reason: int | str | None = None        # the stop string or stop token id that ended it, if any
    new_token_ids: list[int] = field(default_factory=list)   # generated since the previous output
    new_text: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0      # prompt tokens served from the prefix cache
    # Why the engine ended this request alone after add_request (its grammar failed to compile, or its
    # values failed in a step); `outputs` is then empty. errors.is_client_error: the request's fault or not.
    error: Exception | None = None
    prompt_logprobs: list | None = None  # SamplingParams.prompt_logprobs: in the request's final output


def merge_deltas(deltas: list[RequestOutput]) -> RequestOutput:
    """Consecutive DELTA outputs of one request as one, in time linear in their total size."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    merged = []
    for index in sorted({c.index for d in deltas for c in d.outputs}):
        parts = [c for d in deltas for c in d.outputs if c.index == index]
        text = "".join(c.text for c in parts)
        token_ids = list(itertools.chain.from_iterable(c.token_ids for c in parts))
        logprobs = None if parts[-1].logprobs is None else list(itertools.chain.from_iterable(
            c.logprobs or () for c in parts))
        merged.append(CompletionOutput(index, text, token_ids, parts[-1].cumulative_logprob, logprobs,
                                       parts[-1].finish_reason, parts[-1].stop_reason, token_ids, text))
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, merged, last.finished,
                         last.num_cached_tokens, prompt_logprobs=last.prompt_logprobs)
