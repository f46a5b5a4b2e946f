"""The engine's surface, as the code that drives it sees it: the server's AsyncEngine thread and the offline
LLM call only these. LLMEngine implements it, and so does any stand-in (the server tests' FakeEngine,
projects/09_engine/server/fake_engine.py), which then produces its outputs through the same
OutputProcessor and validates with the same SamplingParams."""

from __future__ import annotations

from typing import TYPE_CHECKING, NotRequired, Protocol, TypedDict, runtime_checkable

from .outputs import RequestOutput
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .grammar import GrammarCompileService


class EngineStats(TypedDict):
    """`stats()`: the scheduler's and the KV pool's state, and counters since start."""

    num_running: int                   # requests (not sequences) with a sequence in the running batch
    num_waiting: int                   # the other unfinished requests (queued, preempted, or compiling)
    kv_cache_blocks_total: int
    kv_cache_blocks_free: int
    prefix_cache_queries: int          # tokens looked up in the prefix cache
    prefix_cache_hits: int             # tokens found there
    num_preemptions: int
    num_generated_tokens: int
    weights: NotRequired[str]          # the weight path taken ("quantized" or "float32")
    weight_bytes: NotRequired[int]     # bytes of weights one decode step reads
    resident_weight_bytes: NotRequired[int]
    spec_decode: NotRequired[dict]     # with --speculative-config: Speculator.counters() (vLLM's spec_decode_*)
    lora_requests: NotRequired[dict]   # with enable_lora: {"running"|"waiting": {adapter name: requests}, "max_lora"}


class ServedModel(Protocol):
    """The facts of the configuration a client of the engine reads (EngineConfig has them)."""

    model_name: str
    max_model_len: int
    sampling_defaults: dict            # request defaults from generation_config.json (generation_defaults.py)

    @property
    def vocab_size(self) -> int: ...


class EngineTokenizer(Protocol):
    eos_token_ids: set[int]
    has_vocabulary: bool               # token texts exist (grammars can be compiled against them)
    max_token_chars: int               # the most characters one token decodes to (bounds a prompt's tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids, skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        """template_kwargs: `tools` and the request's chat_template_kwargs, passed to the template."""


@runtime_checkable
class Engine(Protocol):
    config: ServedModel
    tokenizer: EngineTokenizer

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Raises ValueError or TypeError for a prompt or parameters the engine cannot run (a
        RequestFieldError, from SamplingParams.verify, names the field); the engine keeps none of it then."""

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; an output for every request that produced tokens or finished. A request
        whose own values failed in the step finishes alone with `error` set (errors.is_client_error: its
        fault or the engine's); an exception out of step() is a fault of the whole engine."""

    def stats(self) -> EngineStats: ...

    @property
    def grammar_service(self) -> GrammarCompileService | None:
        """Compiles structured-output specs (grammar.py); None where the engine has no grammar engine."""
