"""SamplingParams: how to pick each next token and when to stop, with vLLM's meanings."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import Enum

from kernel_lab.ops.sampling_rules import BOUNDS, RULES, satisfies

from .errors import RequestFieldError
from .logits_processors import (
    SamplingControls,
    check_token_ids,
    validate_allowed_token_ids,
    validate_frequency_penalty,
    validate_logit_bias,
    validate_min_p,
    validate_min_tokens,
    validate_presence_penalty,
    validate_repetition_penalty,
)
from .structured_output import StructuredOutputSpec

SAMPLING_BOUNDS = BOUNDS  # for the layers above, which may not import ops

GREEDY_EPS = 1e-5  # temperatures below this sample greedily (vLLM's threshold)
MAX_LOGPROBS = 20
# What a client controls about the per-step cost of its request: the stop checks scan each new character
# against every stop string, and every bad word's prefix is compared with the output each step.
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS = 16, 1024
MAX_STOP_TOKEN_IDS = 64
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 64, 256


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _bounded_strings(name: str, value, count: int, chars: int, single: bool = False) -> list[str]:
    """A list of at most `count` non-empty strings of at most `chars` characters (`single`: or one string)."""
    items = [value] if single and isinstance(value, str) else value or []
    if isinstance(items, str) or not isinstance(items, (list, tuple)) or len(items) > count or \
            not all(isinstance(x, str) and 0 < len(x) <= chars for x in items):
        raise RequestFieldError(name, f"{name} must be {'a non-empty string or ' if single else ''}a list of at "
                                f"most {count} non-empty strings of at most {chars} characters, got {value!r:.200}")
    for x in items:
        try:
            x.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: no tokenizer takes it and no output holds it
            raise RequestFieldError(name, f"{name} must be valid Unicode text, got {x!r:.200} ({exc.reason} "
                                    f"at {exc.start})") from None
    return list(items)


class RequestOutputKind(Enum):
    """What each of a request's outputs holds (vLLM's): everything so far, only what is new since the
    previous output (so a long stream costs each step only its new tokens), or one output at the end."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class SamplingParams:
    """- n: completions per prompt.
    - temperature: 0 means greedy (argmax); otherwise logits are divided by it before sampling.
    - top_p: nucleus sampling, in (0, 1]; 1 is off. top_k: keep the k most likely tokens; 0 or -1 is off.
    - seed: per-request seed; the same seed and prompt give the same tokens whatever else is batched with it.
    - max_tokens: tokens to generate at most (None: until max_model_len).
    - stop: strings that end the completion (not included in the text unless include_stop_str_in_output).
    - stop_token_ids: token ids that end it (kept in token_ids, as vLLM does).
    - ignore_eos: keep going past the model's EOS tokens.
    - logprobs: return the log-probabilities of this many most likely tokens (and of the sampled one) at
      every step; the values come from the model's raw logits (before temperature, top-k and top-p).
    - detokenize: produce text (off: token ids only, as vLLM's detokenize=False; stop strings need it).
    - output_kind: cumulative outputs every step (default), deltas, or only the final output.
    - presence_penalty, frequency_penalty (in [-2, 2]), repetition_penalty (> 0), logit_bias ({token id:
      bias in [-100, 100]}), min_p (in [0, 1]), min_tokens (stop tokens held back until this many were
      generated), allowed_token_ids, bad_words (strings; the engine tokenises them): the logits processors
      (logits_processors.py), applied in vLLM's order before temperature, min_p, top-k and top-p.
    - structured_outputs: a StructuredOutputSpec (structured_output.py) the output must match.
    - prompt_logprobs: the logprob of every prompt token after the first (and this many top candidates),
      in RequestOutput.prompt_logprobs; such a request bypasses prefix-cache reads (every prompt row goes
      through lm_head) and may ask for max_tokens=0 (score only).

    The reported logprobs are the raw model's, taken before every processor (vLLM's default)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputSpec | None = None
    prompt_logprobs: int | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        """The checks that need no model; `verify` adds those against the model (token-id ranges, the prompt).
        Each failure is a RequestFieldError naming the field."""
        if not _is_int(self.n) or self.n < 1:
            raise RequestFieldError("n", f"n must be an integer >= 1, got {self.n!r}")
        for name, integer in (("temperature", False), ("top_p", False), ("top_k", True)):
            value = getattr(self, name)
            if not (_is_int if integer else _is_number)(value) or not satisfies(name, value):
                raise RequestFieldError(name, f"{name} must be {'an integer' if integer else 'a number'} "
                                        f"{RULES[name]}, got {value!r}")
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        if not satisfies("top_p", struct.unpack("f", struct.pack("f", self.top_p))[0]):  # the sampler's float32
            raise RequestFieldError("top_p", f"top_p must be a number {RULES['top_p']} in float32, got {self.top_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise RequestFieldError("seed", f"seed must be an integer or None, got {self.seed!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise RequestFieldError("prompt_logprobs", f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] "
                                    f"or None, got {self.prompt_logprobs!r}")
        least = 0 if self.prompt_logprobs is not None else 1  # max_tokens=0: score the prompt only
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < least):
            raise RequestFieldError("max_tokens", f"max_tokens must be an integer >= {least} or None, "
                                    f"got {self.max_tokens!r}")
        self.stop_strings = _bounded_strings("stop", self.stop, MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS,
                                             single=True)
        if self.stop_strings and not self.detokenize:
            raise RequestFieldError("stop", "stop strings need detokenize=True")
        ids = self.stop_token_ids or []
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)) or len(ids) > MAX_STOP_TOKEN_IDS:
            raise RequestFieldError("stop_token_ids", f"stop_token_ids must be a list of at most "
                                    f"{MAX_STOP_TOKEN_IDS} token ids, got {self.stop_token_ids!r}")
        check_token_ids("stop_token_ids", ids, None)
        self.stop_token_ids = list(ids)
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestFieldError("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, "
                                    f"got {self.logprobs!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise RequestFieldError("output_kind", f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        self.presence_penalty = validate_presence_penalty(self.presence_penalty)
        self.frequency_penalty = validate_frequency_penalty(self.frequency_penalty)
        self.repetition_penalty = validate_repetition_penalty(self.repetition_penalty)
        self.min_p = validate_min_p(self.min_p)
        self.min_tokens = validate_min_tokens(self.min_tokens, self.max_tokens)
        self.logit_bias = validate_logit_bias(self.logit_bias)
        self.allowed_token_ids = validate_allowed_token_ids(self.allowed_token_ids)
        self.bad_words = _bounded_strings("bad_words", self.bad_words, MAX_BAD_WORDS, MAX_BAD_WORD_CHARS)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputSpec):
            raise RequestFieldError("structured_outputs", f"structured_outputs must be a StructuredOutputSpec, "
                                    f"got {self.structured_outputs!r}")

    def verify(self, vocab_size: int, max_model_len: int | None = None, prompt_token_ids=()) -> None:
        """The checks against the model, the one place each is made (LLMEngine.add_request calls it; the
        server and LLM rely on it): every field that holds token ids, the prompt's ids among them, is in
        [0, vocab_size), and the prompt fits in max_model_len. Raises RequestFieldError naming the field."""
        check_token_ids("prompt", prompt_token_ids, vocab_size)
        if max_model_len is not None and len(prompt_token_ids) > max_model_len:
            raise RequestFieldError("prompt", f"prompt is {len(prompt_token_ids)} tokens long, longer than "
                                    f"max_model_len {max_model_len}")
        check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        check_token_ids("logit_bias", self.logit_bias or (), vocab_size)
        check_token_ids("allowed_token_ids", self.allowed_token_ids or (), vocab_size)

    def controls(self, eos_token_ids, bad_words_token_ids=()) -> SamplingControls | None:
        """This request's logits controls (None when every processor is neutral). `eos_token_ids` is what
        min_tokens holds back besides stop_token_ids (nothing with ignore_eos)."""
        stops = tuple(sorted(set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))))
        controls = SamplingControls(
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias or None, min_p=self.min_p,
            min_tokens=self.min_tokens, stop_token_ids=stops if self.min_tokens else (),
            allowed_token_ids=self.allowed_token_ids, bad_words=tuple(bad_words_token_ids))
        return None if controls == SamplingControls() else controls

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
