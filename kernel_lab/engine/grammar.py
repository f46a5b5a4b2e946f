"""Grammar-constrained decoding through xgrammar: the tokenizer info, a compile service, one matcher per sequence.

- `tokenizer_info(tokenizer, vocab_size)` builds xgrammar's TokenizerInfo from OUR tokenizer's vocabulary
  (`models/tokenizer.py`; byte-level BPE for the bundled SmolLM2). Special tokens other than the stop tokens
  are given an empty text, which xgrammar treats as never allowed (otherwise a chat token such as
  `<|im_start|>` would be a legal piece of a JSON string, as its text is plain characters), and ids past the
  tokenizer's vocabulary (an lm_head padded wider) are empty too.
- `GrammarCompileService` compiles specs (`structured_output.py`) on its own threads, never the engine's:
  `submit(spec)` returns a Future of the compiled grammar, cached by `spec.key`, so a repeated schema costs
  nothing and a request waits on its future (or polls `future.done()`) without blocking the step loop.
- `SequenceMatcher` advances one sequence (n > 1: one matcher each): `accept_token`, `fill_bitmask`,
  `is_terminated`. `fill_step_bitmask(matchers)` gives one step's packed bitmask and the batch rows it applies
  to, for `kernel_lab.ops.apply_token_bitmask`.

xgrammar imports transformers at module level although nothing here uses it; the serving path must not pay
for that import (cold start), so `load_xgrammar` imports xgrammar behind a placeholder `transformers` module
that is removed again afterwards (when transformers is already imported, the real one is used). Only
xgrammar's Hugging Face adapters (`TokenizerInfo.from_huggingface`, `xgrammar.contrib.hf`) would need it.
"""

from __future__ import annotations

import re
import sys
import threading
import types
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from .errors import RequestFieldError
from .structured_output import StructuredOutputSpec, choice_grammar

_IMPORT_LOCK = threading.Lock()
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarCompileError(RequestFieldError):
    """A structured-output value the grammar engine rejected; `param` is the request field."""


class _Placeholder(types.ModuleType):
    """Stands in for `transformers` while xgrammar imports: any public name is an empty class."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (), {"__module__": "transformers"})
        setattr(self, name, cls)
        return cls


def load_xgrammar():
    """The xgrammar module, imported without importing transformers (see the module docstring)."""
    if "xgrammar" in sys.modules:
        return sys.modules["xgrammar"]
    with _IMPORT_LOCK:
        if "transformers" in sys.modules:
            import xgrammar
            return xgrammar
        placeholder = _Placeholder("transformers")
        sys.modules["transformers"] = placeholder
        try:
            import xgrammar
        finally:
            if sys.modules.get("transformers") is placeholder:
                del sys.modules["transformers"]
        return xgrammar


def tokenizer_info(tokenizer, vocab_size: int | None = None, stop_token_ids: Sequence[int] | None = None):
    """xgrammar's TokenizerInfo for a `kernel_lab.models.tokenizer.Tokenizer`.

    vocab_size: the model's lm_head width (default: the tokenizer's); stop_token_ids: the tokens that end a
    sequence (default: the tokenizer's EOS ids), the only ones a finished grammar allows."""
    xgr = load_xgrammar()
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    size = max(len(vocab), max(vocab.values()) + 1)
    vocab_size = size if vocab_size is None else int(vocab_size)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    stops = sorted(tokenizer.eos_token_ids if stop_token_ids is None else stop_token_ids)
    if not stops:
        raise ValueError("stop_token_ids must name at least one token (the tokenizer has no EOS id)")
    encoded = [""] * vocab_size
    for token, index in vocab.items():
        if index < vocab_size:
            encoded[index] = token
    for index in set(tokenizer.all_special_ids) - set(stops):
        if index < vocab_size:
            encoded[index] = ""
    # The pre-tokenizer and decoder in tokenizer.json say how the vocabulary is encoded (byte-level here).
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=stops,
                             add_prefix_space=meta["add_prefix_space"])


class GrammarCompileService:
    """Compiles structured-output specs off the calling thread, with a cache keyed by the spec.

    submit(spec) -> Future[xgrammar.CompiledGrammar]; the future raises GrammarCompileError (naming
    `spec.param`) for a value the engine rejects. Futures are cached, the failed ones too (the same value
    fails the same way), least recently used first out beyond `cache_size`. JSON is compiled without free
    whitespace (`{"a": 1}` style, one space after `:` and `,`), so a model cannot pad its output forever."""

    def __init__(self, info, max_workers: int = 2, cache_size: int = 512, compiler_threads: int = 2):
        xgr = load_xgrammar()
        self.info = info
        self.vocab_size = info.vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=compiler_threads)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kl-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int | None = None, **kwargs) -> GrammarCompileService:
        return cls(tokenizer_info(tokenizer, vocab_size), **kwargs)

    def submit(self, spec: StructuredOutputSpec) -> Future:
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: StructuredOutputSpec, timeout: float | None = None):
        """The compiled grammar, waiting for it (tests, tools); the engine uses `submit`."""
        return self.submit(spec).result(timeout)

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)

    def _compile(self, spec: StructuredOutputSpec):
        try:
            if spec.kind == "json":
                return self._compiler.compile_json_schema(spec.value, any_whitespace=False,
                                                          strict_mode=spec.strict)
            if spec.kind == "json_object":  # OpenAI's JSON mode: an object (xgrammar's builtin allows any value)
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                          strict_mode=False)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                return self._compiler.compile_grammar(choice_grammar(spec.choices))
            if spec.kind == "grammar":
                return self._compiler.compile_grammar(spec.value)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses with the reason
            lines = str(exc).strip().splitlines()
            # xgrammar prefixes its messages with a time and its C++ source location; the reason follows
            reason = _XGRAMMAR_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
            message = f"{spec.param}: the {spec.kind} could not be compiled: {reason}"
            raise GrammarCompileError(spec.param, message) from exc
        raise GrammarCompileError(spec.param, f"{spec.param}: unknown structured output kind {spec.kind!r}")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class SequenceMatcher:
    """The grammar state of one sequence: which tokens may come next, advanced token by token."""

    def __init__(self, compiled):
        xgr = load_xgrammar()
        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = compiled.tokenizer_info.vocab_size

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar does not allow it."""
        return bool(self._matcher.accept_token(int(token_id)))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed next tokens into row `row` of a CPU int32 [rows, ceil(vocab / 32)] bitmask."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """True once the grammar accepted a stop token: the sequence ends."""
        return bool(self._matcher.is_terminated())

    def is_completed(self) -> bool:
        """True where the output so far is a complete match (a stop token is allowed next)."""
        return bool(self._matcher.is_completed())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculation walks a sequence's drafts, then returns)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fork(self) -> SequenceMatcher:
        """An independent copy in the same state (n > 1 samples of one prompt)."""
        twin = object.__new__(SequenceMatcher)
        twin._matcher, twin.vocab_size = self._matcher.fork(), self.vocab_size
        return twin


class GrammarRequest:
    """A request's grammar from submission to its sequences' matchers: the scheduler keeps the request
    waiting while `ready()` is False, fails it (a 400, freeing its blocks) when `error()` is set, and asks
    `matcher(i)` for sequence i (n > 1: one independent matcher per sequence) once it is ready."""

    def __init__(self, service: GrammarCompileService, spec: StructuredOutputSpec):
        self.spec = spec
        self.future = service.submit(spec)
        self._matchers: dict[int, SequenceMatcher] = {}

    def ready(self) -> bool:
        return self.future.done()

    def error(self) -> BaseException | None:
        """The compile error (GrammarCompileError for a bad value), once done; None while pending or fine."""
        return self.future.exception() if self.future.done() else None

    def matcher(self, index: int = 0) -> SequenceMatcher:
        if not self.ready():
            raise RuntimeError("the grammar is still compiling: keep the request waiting until ready()")
        if index not in self._matchers:
            self._matchers[index] = SequenceMatcher(self.future.result())
        return self._matchers[index]


class StructuredOutputManager:
    """The engine's structured-output state: the compile service (built on first use from the engine's
    tokenizer, so xgrammar loads only when a request needs it; thread-safe, as the server submits to it from
    its event loop) and the requests waiting for their grammar, which hold no slot and no blocks yet."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._service: GrammarCompileService | None = None
        self._lock = threading.Lock()
        self.waiting: list = []             # Requests, in arrival order

    @property
    def service(self) -> GrammarCompileService | None:
        """None for a tokenizer without token texts (a random-weight model's token ids only)."""
        if not self._tokenizer.has_vocabulary:
            return None
        with self._lock:
            if self._service is None:
                self._service = GrammarCompileService.for_tokenizer(self._tokenizer, self._vocab_size)
            return self._service

    def add(self, request) -> None:
        service = self.service
        if service is None:
            raise ValueError("structured outputs need a tokenizer with token texts; this model has token ids only")
        request.grammar = GrammarRequest(service, request.params.structured_outputs)
        self.waiting.append(request)

    def remove(self, request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)

    def take_compiled(self) -> tuple[list, list]:
        """(ready, failed): the waiting requests whose grammar compiled, each sequence given its matcher, and
        those whose grammar failed, with `request.error` set. Both leave the waiting list."""
        ready, failed, still = [], [], []
        for request in self.waiting:
            if not request.grammar.ready():
                still.append(request)
            elif (error := request.grammar.error()) is not None:
                request.error = error
                failed.append(request)
            else:
                for seq in request.seqs:
                    seq.matcher = request.grammar.matcher(seq.index)
                ready.append(request)
        self.waiting = still
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until some waiting grammar is done or `timeout` passes (the engine has nothing else to do)."""
        wait([r.grammar.future for r in self.waiting], timeout, FIRST_COMPLETED)

def fill_step_bitmask(matchers: Sequence[SequenceMatcher | None],
                      out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One decode step's masks: (bitmask [n, words] int32, rows [n] int64) for the batch rows whose matcher
    is not None and not terminated, or None when no row is constrained. `out` (CPU int32 [>= n, words]) is
    reused when given, so a step allocates nothing."""
    rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    if not rows:
        return None
    vocab = matchers[rows[0]].vocab_size
    words = (vocab + 31) // 32
    if out is None or out.shape[0] < len(rows) or out.shape[1] != words:
        out = torch.empty((len(rows), words), dtype=torch.int32)
    bitmask = out[:len(rows)]
    for slot, r in enumerate(rows):
        matchers[r].fill_bitmask(bitmask, slot)
    return bitmask, torch.tensor(rows, dtype=torch.int64)
