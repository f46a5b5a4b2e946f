"""The sampling controls that edit logits before a token is drawn, as batched tensor ops (CPU and CUDA alike).

Order (vLLM's v1 sampler), each applied only to the rows that use it:

1. `allowed_token_ids`: every other token -> -inf;
2. `bad_words`: a one-token bad word is always banned; a longer one bans its last token only when the
   sequence's output so far ends with the rest of it (vLLM matches against the output tokens, not the prompt);
3. `min_tokens`: while fewer than min_tokens tokens have been generated, the stop tokens (EOS unless
   ignore_eos, and stop_token_ids) -> -inf;
4. `logit_bias`: logits[token] += bias;
5. penalties: `repetition_penalty` r on every token of prompt + output (a logit x > 0 becomes x / r, else
   x * r), then `frequency_penalty` f and `presence_penalty` p on the output tokens: x -= f * count + p * [count > 0];
6. then, in the sampler: temperature, `min_p`, top-k / top-p. `apply_min_p` here works on the logits before
   temperature T: a token is kept iff softmax(x / T)_i >= min_p * max_j softmax(x / T)_j, i.e. iff
   x_i >= max x + T * ln(min_p), so it composes with `kernel_lab.ops.sample`, which takes temperature itself.
   A greedy row (T = 0) keeps its argmax in every case and is left alone.

The per-step state (`LogitsState`) is built from each row's `SamplingControls` and token lists by
`build_logits_state`; a processor no row uses costs nothing (its tensors are None), and the tensors cover only
the rows that use it (`rows` indices). The penalties are sparse: one entry per distinct (row, token) of the
penalised rows' prompts and outputs, with its output count, found by `torch.unique` on row * vocab + token,
so a step costs O(tokens seen) and never touches the rest of the vocabulary.

Validation (`validate_*`): the ranges of vLLM and OpenAI, as ValueError naming the parameter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .errors import RequestFieldError

NEG_INF = float("-inf")


# ------------------------------------------------------------------------------------------- validation
def _number(name: str, value, param: str | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestFieldError(param or name, f"{name} must be a finite number, got {value!r}")
    return float(value)


def _in_range(name: str, value, low: float, high: float) -> float:
    value = _number(name, value)
    if not low <= value <= high:
        raise RequestFieldError(name, f"{name} must be in [{low:g}, {high:g}], got {value}")
    return value


def validate_presence_penalty(value) -> float:
    return _in_range("presence_penalty", value, -2.0, 2.0)


def validate_frequency_penalty(value) -> float:
    return _in_range("frequency_penalty", value, -2.0, 2.0)


def validate_repetition_penalty(value) -> float:
    value = _number("repetition_penalty", value)
    if not value > 0.0:
        raise RequestFieldError("repetition_penalty", f"repetition_penalty must be > 0, got {value}")
    return value


def validate_min_p(value) -> float:
    return _in_range("min_p", value, 0.0, 1.0)


def validate_min_tokens(value, max_tokens: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestFieldError("min_tokens", f"min_tokens must be an integer >= 0, got {value!r}")
    if max_tokens is not None and value > max_tokens:
        raise RequestFieldError("min_tokens", f"min_tokens ({value}) must be <= max_tokens ({max_tokens})")
    return value


def _token_id(name: str, token, vocab_size: int | None) -> int:
    """A token id; `vocab_size` None checks the type only (the range needs the model: SamplingParams.verify)."""
    if isinstance(token, str):  # JSON object keys are strings: {"50256": -100}
        try:
            token = int(token)
        except ValueError:
            raise RequestFieldError(name, f"{name} keys must be token ids, got {token!r}") from None
    if isinstance(token, bool) or not isinstance(token, int) or token < 0 or \
            (vocab_size is not None and token >= vocab_size):
        bound = ">= 0" if vocab_size is None else f"in [0, {vocab_size})"
        raise RequestFieldError(name, f"{name} token ids must be integers {bound}, got {token!r}")
    return token


def check_token_ids(name: str, ids, vocab_size: int | None) -> None:
    for token in ids:
        _token_id(name, token, vocab_size)


def validate_logit_bias(bias, vocab_size: int | None = None) -> dict[int, float] | None:
    """{token id: bias} with ids >= 0 (in [0, vocab_size) when given; string keys accepted) and biases in
    [-100, 100]."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise RequestFieldError("logit_bias", "logit_bias must be an object mapping token ids to biases, got "
                                f"{type(bias).__name__}")
    out = {}
    for key, value in bias.items():
        token = _token_id("logit_bias", key, vocab_size)
        value = _number(f"logit_bias[{key!r}]", value, "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise RequestFieldError("logit_bias", f"logit_bias values must be in [-100, 100], got {value} for "
                                    f"token {token}")
        out[token] = value
    return out


def validate_allowed_token_ids(ids, vocab_size: int | None = None) -> tuple[int, ...] | None:
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple)) or not ids:
        raise RequestFieldError("allowed_token_ids", f"allowed_token_ids must be a non-empty list of token ids, "
                                f"got {ids!r}")
    return tuple(sorted({_token_id("allowed_token_ids", t, vocab_size) for t in ids}))


def validate_bad_words_token_ids(words, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """Bad words as token-id sequences (the tokenizer's job is the caller's: vLLM tokenises each word both
    with and without a leading space)."""
    if not words:
        return ()
    out = []
    for word in words:
        if not isinstance(word, (list, tuple)) or not word:
            raise RequestFieldError("bad_words", f"bad_words entries must be non-empty token-id lists, got {word!r}")
        out.append(tuple(_token_id("bad_words", t, vocab_size) for t in word))
    return tuple(out)


def bad_words_token_ids(tokenizer, words: Sequence[str]) -> list[tuple[int, ...]]:
    """`bad_words` strings as token sequences: each as written and after a space (mid-text), as vLLM
    tokenises them."""
    out = set()
    for word in words:
        for text in {word, word if word.startswith(" ") else " " + word}:
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids:
                out.add(tuple(ids))
    return sorted(out)

# ------------------------------------------------------------------------------------------- per-row controls
@dataclass(frozen=True)
class SamplingControls:
    """One row's logits controls, already validated. `stop_token_ids`: what min_tokens holds back."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclass
class Penalties:
    """The (row, token) pairs a penalty touches: every token in a penalised row's prompt or output, once.
    A step costs O(tokens seen), not O(rows * vocab)."""

    rows: torch.Tensor          # [N] int64 batch rows
    tokens: torch.Tensor        # [N] int64
    counts: torch.Tensor        # [N] float32 occurrences in the output (0: in the prompt only)
    presence: torch.Tensor      # [N] the pair's row's presence_penalty
    frequency: torch.Tensor     # [N]
    repetition: torch.Tensor    # [N]


@dataclass
class LogitsState:
    """One step's batched processor inputs; None fields are processors no row uses."""

    allowed_rows: torch.Tensor | None = None       # [R] rows
    allowed_mask: torch.Tensor | None = None       # [R, V] bool, True = allowed
    banned: tuple[torch.Tensor, torch.Tensor] | None = None       # (rows, tokens): bad words' last tokens
    min_tokens_ban: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, tokens): stop tokens held back
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, tokens, values)
    penalties: Penalties | None = None
    min_p: torch.Tensor | None = None              # [B] (0 where unused)


def _pairs(pairs: list[tuple[int, int]], device) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not pairs:
        return None
    t = torch.tensor(pairs, dtype=torch.int64).t()
    return t[0].to(device), t[1].to(device)


def _bad_word_bans(words: Sequence[tuple[int, ...]], output: Sequence[int]) -> list[int]:
    banned = []
    for word in words:
        prefix = word[:-1]
        if len(output) >= len(prefix) and tuple(output[len(output) - len(prefix):]) == prefix:
            banned.append(word[-1])
    return banned


def _keys(rows: Sequence[int], lists: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """row * vocab + token for every token of every list (int64)."""
    parts = [torch.as_tensor(list(x), dtype=torch.int64) + r * vocab_size for r, x in zip(rows, lists)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def _penalties(controls, rows: list[int], prompts, outputs, vocab_size: int, device) -> Penalties:
    out_keys, out_counts = torch.unique(_keys(rows, [outputs[i] for i in rows], vocab_size), return_counts=True)
    seen = torch.unique(torch.cat([_keys(rows, [prompts[i] for i in rows], vocab_size), out_keys]))
    at = torch.searchsorted(out_keys, seen).clamp(max=max(len(out_keys) - 1, 0))
    found = out_keys[at] == seen if len(out_keys) else torch.zeros_like(seen, dtype=torch.bool)
    counts = torch.where(found, out_counts[at] if len(out_keys) else 0, 0).float()
    pair_rows = seen // vocab_size

    def per_pair(name):
        value = torch.zeros(len(controls))
        value[rows] = torch.tensor([getattr(controls[i], name) for i in rows])
        return value[pair_rows].to(device)

    return Penalties(rows=pair_rows.to(device), tokens=(seen % vocab_size).to(device), counts=counts.to(device),
                     presence=per_pair("presence_penalty"), frequency=per_pair("frequency_penalty"),
                     repetition=per_pair("repetition_penalty"))


def build_logits_state(controls: Sequence[SamplingControls | None], prompt_token_ids: Sequence[Sequence[int]],
                       output_token_ids: Sequence[Sequence[int]], vocab_size: int, device="cpu") -> LogitsState:
    """The step's state for a batch: row i has `controls[i]` (None: no controls) and its token lists."""
    if not len(controls) == len(prompt_token_ids) == len(output_token_ids):
        raise ValueError("controls, prompt_token_ids and output_token_ids must have one entry per batch row")
    state = LogitsState()
    allowed = [(i, c.allowed_token_ids) for i, c in enumerate(controls) if c and c.allowed_token_ids is not None]
    if allowed:
        mask = torch.zeros((len(allowed), vocab_size), dtype=torch.bool)
        for slot, (_, ids) in enumerate(allowed):
            mask[slot, list(ids)] = True
        state.allowed_rows = torch.tensor([i for i, _ in allowed], dtype=torch.int64, device=device)
        state.allowed_mask = mask.to(device)
    bans, held, bias = [], [], []
    for i, c in enumerate(controls):
        if c is None:
            continue
        bans += [(i, t) for t in _bad_word_bans(c.bad_words, output_token_ids[i])]
        if len(output_token_ids[i]) < c.min_tokens:
            held += [(i, t) for t in c.stop_token_ids]
        bias += [(i, t, v) for t, v in (c.logit_bias or {}).items() if v != 0.0]
    state.banned, state.min_tokens_ban = _pairs(bans, device), _pairs(held, device)
    if bias:
        rows, tokens = _pairs([(r, t) for r, t, _ in bias], device)
        state.bias = (rows, tokens, torch.tensor([v for _, _, v in bias], dtype=torch.float32, device=device))
    penal = [i for i, c in enumerate(controls) if c and c.has_penalties]
    if penal:
        state.penalties = _penalties(controls, penal, prompt_token_ids, output_token_ids, vocab_size, device)
    if any(c and c.min_p > 0.0 for c in controls):
        state.min_p = torch.tensor([c.min_p if c else 0.0 for c in controls], dtype=torch.float32, device=device)
    return state


# ------------------------------------------------------------------------------------------- the processors
def apply_allowed_token_ids(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> None:
    logits[rows] = logits[rows].masked_fill(~allowed, NEG_INF)


def apply_bans(logits: torch.Tensor, pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
    logits[pairs] = NEG_INF


def apply_logit_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    rows, tokens, values = bias
    logits.index_put_((rows, tokens), values.to(logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    x = logits[p.rows, p.tokens].float()
    x = torch.where(x > 0, x / p.repetition, x * p.repetition)
    x = x - p.frequency * p.counts - p.presence * (p.counts > 0).float()
    logits[p.rows, p.tokens] = x.to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor, temperature: torch.Tensor) -> None:
    """Mask the tokens min_p removes, on the logits before temperature (see the module docstring)."""
    live = (min_p > 0) & (temperature > 0)
    if not bool(live.any()):
        return
    rows = torch.nonzero(live).squeeze(1)
    x = logits[rows]
    floor = x.max(dim=1, keepdim=True).values + temperature[rows, None].to(x.dtype) * torch.log(
        min_p[rows, None].to(x.dtype))
    logits[rows] = x.masked_fill(x < floor, NEG_INF)


def apply_logits_processors(logits: torch.Tensor, state: LogitsState) -> torch.Tensor:
    """Steps 1-5 in place on [batch, vocab] logits (compute in float32: vLLM converts first); returns them."""
    if state.allowed_rows is not None:
        apply_allowed_token_ids(logits, state.allowed_rows, state.allowed_mask)
    if state.banned is not None:
        apply_bans(logits, state.banned)
    if state.min_tokens_ban is not None:
        apply_bans(logits, state.min_tokens_ban)
    if state.bias is not None:
        apply_logit_bias(logits, state.bias)
    if state.penalties is not None:
        apply_penalties(logits, state.penalties)
    return logits
