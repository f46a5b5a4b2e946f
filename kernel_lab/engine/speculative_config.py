"""`--speculative-config`: vLLM's JSON for speculative decoding, parsed and checked once, where it enters
(EngineConfig). Two proposers: n-gram prompt lookup (`"method": "ngram"`) and a draft model (`"model": PATH`,
method omitted or vLLM's `"draft_model"`; our key `"weights"` picks the draft's weight path, as `--weights`
does the target's: auto | quantized | float32). `"acceptance_method"` picks how a draft model's drafts are
verified: vLLM's `"rejection_sampler"` (the default: accept with min(1, p/q), the maximal acceptance rate, the
target's distribution exactly) or our `"coupled"` (accept iff the draft equals the target's own keyed draw: the
output is the output without speculation, token for token). For n-gram drafts (one-hot q) they are one rule."""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_SPECULATIVE_TOKENS = 16      # ops.rejection_sample's bound on drafts per sequence
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
         "model", "weights", "acceptance_method")
_WEIGHTS = ("auto", "quantized", "float32")
# vLLM's name -> ops.rejection_sample's rule
ACCEPTANCE_METHODS = {"rejection_sampler": "rejection", "coupled": "coupled"}


def _positive_int(raw: dict, key: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config.{key} must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    # vLLM's: no drafts in a step with more running sequences than this (None: never off). On a CPU a step's
    # cost grows with its rows once the batch is compute-bound, and extra draft rows stop paying there.
    disable_by_batch_size: int | None = None
    model: str | None = None        # the draft model (method "draft_model")
    weights: str = "auto"           # the draft's weight path
    acceptance_method: str = "rejection_sampler"

    @property
    def rule(self) -> str:
        """ops.rejection_sample's rule for the draft model's drafts."""
        return ACCEPTANCE_METHODS[self.acceptance_method]

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """From a JSON string (the command line), a dict (`LLM(speculative_config=...)`), a SpeculativeConfig
        or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(_KEYS)})")
        model, method = value.get("model"), value.get("method")
        if model is not None:
            if not isinstance(model, str) or not model:
                raise ValueError(f"speculative_config.model must be a path (a .gguf file or a Hugging Face "
                                 f"directory), got {model!r}")
            if method is None:
                method = "draft_model"
            if method != "draft_model":
                raise ValueError(f"speculative_config.method must be 'draft_model' (or omitted) with a model, "
                                 f"got {method!r}")
        elif method == "draft_model":
            raise ValueError("speculative_config.model is required with method 'draft_model'")
        elif method != "ngram":
            raise ValueError(f"speculative_config.method must be 'ngram' or 'draft_model' (with a model), "
                             f"got {method!r}")
        weights = value.get("weights", "auto")
        if weights not in _WEIGHTS or model is None and "weights" in value:
            raise ValueError(f"speculative_config.weights (the draft model's) must be one of {_WEIGHTS}, "
                             f"got {weights!r}" + ("" if model else " without a model"))
        acceptance = value.get("acceptance_method", "rejection_sampler")
        if acceptance not in ACCEPTANCE_METHODS:
            raise ValueError(f"speculative_config.acceptance_method must be one of "
                             f"{tuple(ACCEPTANCE_METHODS)}, got {acceptance!r}")
        k = _positive_int(value, "num_speculative_tokens")
        if k is None:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        if k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                             f"got {k}")
        hi, lo = _positive_int(value, "prompt_lookup_max"), _positive_int(value, "prompt_lookup_min")
        # vLLM's defaults: one bound given stands for both; neither given is 5 and 5
        if hi is None and lo is None:
            hi = lo = 5
        hi = lo if hi is None else hi
        lo = hi if lo is None else lo
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        return cls(method, k, hi, lo, _positive_int(value, "disable_by_batch_size"), model, weights, acceptance)
