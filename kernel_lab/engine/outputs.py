"""What the engine returns: RequestOutput and CompletionOutput (vLLM's shapes, plus streaming deltas)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int                       # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int                                  # which of the request's n completions
    text: str                                   # cumulative text
    token_ids: list[int]                        # cumulative generated ids
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None   # one dict per generated token, when requested
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
