"""A tiny, deterministic stand-in for `kernel_lab.engine.LLMEngine`: the same surface
(`kernel_lab.engine.interface.Engine`), the same SamplingParams and the same requests, outputs and output
processor (detokenisation, stop conditions, deltas), the same logits processors and grammar bitmask (the
real `Sampler.process`), the same grammar service and structured-output manager (xgrammar, over this
character vocabulary), with a fake model and a fake KV pool in place of the scheduler and the runner. So the
server's tests exercise every path (queues, aborts, stop strings, n > 1, seeds, logprobs, KV accounting,
penalties, logit_bias, min_tokens, allowed ids, bad words, structured outputs and forced tool calls) in
milliseconds, without a model, against the engine's own rules, and a fault in those rules reaches them.

The "model" is a character-level language: a token is one printable ASCII character (ids 3..97) plus
three specials (0 pad, 1 bos, 2 eos). Greedy decoding spells out a fixed sentence starting at an offset
derived from the context, so the text is predictable enough to aim stop strings at; sampling draws from a
small fixed distribution with a per-sequence `random.Random(seed)`. A row that some processor or grammar
touches is decided from the processed logits instead: its argmax when greedy, else a draw from their
softmax with the same per-sequence generator.
"""

from __future__ import annotations

import math
import random
import threading
import time
import zlib
from dataclasses import dataclass, field

import torch

from kernel_lab.engine.block_manager import blocks_needed
from kernel_lab.engine.errors import RequestFieldError
from kernel_lab.engine.grammar import GrammarCompileService, StructuredOutputManager, load_xgrammar
from kernel_lab.engine.interface import EngineStats
from kernel_lab.engine.logits_processors import bad_words_token_ids
from kernel_lab.engine.output_processor import OutputProcessor
from kernel_lab.engine.outputs import RequestOutput
from kernel_lab.engine.sampler import Sampler, SampleResult
from kernel_lab.engine.sampling_params import SamplingParams
from kernel_lab.engine.sequence import Request, Sequence, SequenceStatus

PAD, BOS, EOS = 0, 1, 2
FIRST_CHAR, LAST_CHAR = 32, 126  # printable ASCII
VOCAB_SIZE = 3 + (LAST_CHAR - FIRST_CHAR + 1)
SENTENCE = "the quick brown fox jumps over the lazy dog. "


class FakeTokenizer:
    eos_token_ids = {EOS}
    has_vocabulary = True
    vocab_size = VOCAB_SIZE
    max_token_chars = 1  # one character per token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [
            ord(c) - FIRST_CHAR + 3 if FIRST_CHAR <= ord(c) <= LAST_CHAR else ord("?") - FIRST_CHAR + 3 for c in text
        ]
        return ([BOS] if add_special_tokens else []) + ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            if i < 3:
                if not skip_special_tokens:
                    out.append(("<pad>", "<s>", "</s>")[i])
                continue
            out.append(chr(i - 3 + FIRST_CHAR))
        return "".join(out)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None, **kwargs) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if tools:
            text = "<tools>" + ",".join(t["function"]["name"] for t in tools) + "\n" + text
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text)


@dataclass
class FakeConfig:
    model_name: str
    max_model_len: int
    vocab_size: int = VOCAB_SIZE
    sampling_defaults: dict = field(default_factory=dict)  # a generation_config.json's request defaults


# Fixed candidate distribution for sampling: characters of the sentence, the first the most likely.
_CANDIDATES = sorted(set(SENTENCE))
_LOGITS = [-(i % 7) * 0.5 for i in range(len(_CANDIDATES))]
_LOGZ = math.log(sum(math.exp(x) for x in _LOGITS))
_LOGPROBS = {ord(c) - FIRST_CHAR + 3: lg - _LOGZ for c, lg in zip(_CANDIDATES, _LOGITS, strict=False)}
_RANKED = sorted(_LOGPROBS.items(), key=lambda kv: -kv[1])


# The fake model's logits: the candidates at their logprobs, every other token far below, and the token the
# fake model "means" (greedy, scripted, EOS) far above, so an unprocessed argmax is that token.
_FLOOR_LOGIT, _CHOSEN_LOGIT = -20.0, 5.0
_BASE_LOGITS = torch.full((VOCAB_SIZE,), _FLOOR_LOGIT)
_BASE_LOGITS[list(_LOGPROBS)] = torch.tensor(list(_LOGPROBS.values()))


def _to_tensor(name: str, values: list, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


class FakeStructuredOutputs(StructuredOutputManager):
    """The engine's structured-output manager with a compile service over the fake's vocabulary: a token is
    its one character (raw bytes), the specials have no text, EOS ends a grammar. xgrammar loads on the first
    structured request, as in the engine."""

    @property
    def service(self) -> GrammarCompileService:
        with self._lock:
            if self._service is None:
                xgr = load_xgrammar()
                texts = ["", "", ""] + [chr(c) for c in range(FIRST_CHAR, LAST_CHAR + 1)]
                info = xgr.TokenizerInfo(texts, xgr.VocabType.RAW, vocab_size=VOCAB_SIZE, stop_token_ids=[EOS])
                self._service = GrammarCompileService(info, max_workers=1, compiler_threads=1)
            return self._service


def _seq_rng(seq: Sequence) -> random.Random:
    seed = seq.params.seed
    return random.Random((seed if seed is not None else random.getrandbits(32)) + seq.index)


class FakeEngine:
    """Deterministic engine with the LLMEngine surface. `step_delay_s` makes steps slow, and `gate`
    (a threading.Event, set by default) pauses stepping while cleared, for queue-full and disconnect
    tests. `eos_after` makes greedy sequences end with EOS after that many tokens (None: never); `script`
    makes greedy sequences write that text and then EOS (a scripted model, e.g. one that calls a tool)."""

    def __init__(
        self,
        model=None,
        max_model_len: int = 256,
        max_num_seqs: int = 8,
        block_size: int = 4,
        num_kv_blocks: int = 512,
        step_delay_s: float = 0.0,
        eos_after: int | None = None,
        script: str | None = None,
        load_delay_s: float = 0.0,
        fail_load: str | None = None,
        sampling_defaults: dict | None = None,
        **_ignored,
    ):
        if load_delay_s:
            time.sleep(load_delay_s)
        if fail_load:
            raise RuntimeError(fail_load)
        self.tokenizer = FakeTokenizer()
        self.config = FakeConfig("fake-model", max_model_len, sampling_defaults=dict(sampling_defaults or {}))
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.free_blocks = num_kv_blocks
        self.step_delay_s = step_delay_s
        self.eos_after = eos_after
        self.script = script
        self.gate = threading.Event()
        self.gate.set()
        self.output_processor = OutputProcessor(self.tokenizer, max_model_len, self._release)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.ids: set[str] = set()
        self.aborted: list[str] = []
        self.blocks: dict[str, int] = {}
        self.offsets: dict[str, int] = {}
        self.rngs: dict[int, random.Random] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.steps = 0
        self.num_generated_tokens = 0
        self.structured_outputs = FakeStructuredOutputs(self.tokenizer, VOCAB_SIZE)
        self.sampler = Sampler(0, _to_tensor)

    @property
    def grammar_service(self) -> GrammarCompileService:
        return self.structured_outputs.service

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        if params.prompt_logprobs is not None:
            raise RequestFieldError("prompt_logprobs", "the fake engine has no model to score prompts with")
        if request_id in self.ids:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestFieldError("prompt", "prompt must not be empty")
        params.verify(VOCAB_SIZE, self.config.max_model_len, ids)   # the engine's one check
        request = Request(request_id, prompt if isinstance(prompt, str) else None, ids, params, arrival=0)
        request.controls = params.controls(self.tokenizer.eos_token_ids,
                                           bad_words_token_ids(self.tokenizer, params.bad_words))
        if params.structured_outputs is not None:
            self.structured_outputs.add(request)     # joins `waiting` once its grammar is compiled
        self.ids.add(request_id)
        self.output_processor.add_request(request)
        self.offsets[request_id] = zlib.crc32(bytes(i % 256 for i in ids)) % len(SENTENCE)
        self.rngs.update((seq.seq_id, _seq_rng(seq)) for seq in request.seqs)
        self.blocks[request_id] = 0
        if request.grammar is None:
            self.waiting.append(request)

    def abort_request(self, request_id: str) -> None:
        for req in list(self.structured_outputs.waiting):
            if req.request_id == request_id:
                self.structured_outputs.remove(req)
                self._free(req)
                self.aborted.append(request_id)
        for queue in (self.waiting, self.running):
            for req in list(queue):
                if req.request_id == request_id:
                    queue.remove(req)
                    self._free(req)
                    self.aborted.append(request_id)

    def _free(self, req: Request) -> None:
        self.free_blocks += self.blocks.pop(req.request_id)
        self.offsets.pop(req.request_id)
        for seq in req.seqs:
            self.rngs.pop(seq.seq_id)
        self.ids.discard(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.structured_outputs.waiting)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.structured_outputs.waiting),   # requests, as the engine counts
            kv_cache_blocks_total=self.num_kv_blocks, kv_cache_blocks_free=self.free_blocks,
            prefix_cache_queries=self.prefix_queries, prefix_cache_hits=self.prefix_hits, num_preemptions=0,
            num_generated_tokens=self.num_generated_tokens,
        )

    # ---------------------------------------------------------------- stepping
    def _blocks_needed(self, req: Request) -> int:
        longest = max(s.num_output_tokens for s in req.seqs) + 1
        return req.params.n * blocks_needed(len(req.prompt_token_ids) + longest, self.block_size)

    @staticmethod
    def _release(seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED

    def step(self) -> list[RequestOutput]:
        self.gate.wait()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.steps += 1
        outputs = self._admit_compiled() if self.structured_outputs.waiting else []
        if self.structured_outputs.waiting and not (self.waiting or self.running or outputs):
            self.structured_outputs.wait(0.05)   # nothing else to do
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            need = self._blocks_needed(req)
            if need > self.free_blocks:
                break
            self.waiting.pop(0)
            self.free_blocks -= need
            self.blocks[req.request_id] = need
            self.prefix_queries += len(req.prompt_token_ids)
            self.prefix_hits += len(req.prompt_token_ids) // 2
            self.running.append(req)
        results, failures = [], []
        for req in list(self.running):
            need = self._blocks_needed(req)
            self.free_blocks -= need - self.blocks[req.request_id]
            self.blocks[req.request_id] = need
            seqs = [seq for seq in req.seqs if not seq.is_finished]
            try:
                results += self._sample(req, seqs)
            except Exception as exc:  # noqa: BLE001 - this request's values, as in Sampler.sample_each
                failures += [(seq, exc) for seq in seqs]
        self.num_generated_tokens += len(results)
        outputs += self.output_processor.process(results, failures)
        for req in list(self.running):
            if req.finished:
                self.running.remove(req)
                self._free(req)
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """As LLMEngine's: compiled requests join the queue, failed ones end with their error."""
        ready, failed = self.structured_outputs.take_compiled()
        self.waiting.extend(ready)
        for request in failed:
            for seq in request.seqs:
                seq.finish_reason = "abort"
                seq.status = SequenceStatus.FINISHED
            self._free(request)
        return [RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, [], True, error=r.error) for r in failed]

    def _meant_token(self, req: Request, seq: Sequence) -> int | None:
        """The token the fake model means at this position (None: it samples from the candidates)."""
        p = req.params
        pos = seq.num_output_tokens
        if self.eos_after is not None and pos >= self.eos_after and not p.ignore_eos:
            return EOS
        if p.greedy and self.script is not None:
            return ord(self.script[pos]) - FIRST_CHAR + 3 if pos < len(self.script) else EOS
        if p.greedy:
            return ord(SENTENCE[(self.offsets[req.request_id] + pos) % len(SENTENCE)]) - FIRST_CHAR + 3
        return None

    def _sample(self, req: Request, seqs: list[Sequence]) -> list[SampleResult]:
        meant = [self._meant_token(req, seq) for seq in seqs]
        if req.controls is None and req.grammar is None:
            tokens = [self._draw_candidate(seq) if m is None else m for seq, m in zip(seqs, meant, strict=True)]
        else:
            tokens = self._sample_processed(req, seqs, meant)
        return [self._result(req, seq, token) for seq, token in zip(seqs, tokens, strict=True)]

    def _draw_candidate(self, seq: Sequence) -> int:
        weights = [math.exp(lp / seq.params.temperature) for lp in _LOGPROBS.values()]
        return self.rngs[seq.seq_id].choices(list(_LOGPROBS), weights=weights)[0]

    def _sample_processed(self, req: Request, seqs: list[Sequence], meant: list[int | None]) -> list[int]:
        """Through the engine's own processors and grammar bitmask: the argmax of the processed logits
        (greedy, or a meant EOS), or a draw from their softmax at the request's temperature."""
        logits = _BASE_LOGITS.repeat(len(seqs), 1)
        for row, token in enumerate(meant):
            if token is not None:
                logits[row, token] = _CHOSEN_LOGIT
        p = req.params
        temperature = None if p.greedy else torch.full((len(seqs),), p.temperature)
        processed = self.sampler.process(logits, seqs, temperature)
        tokens = []
        for row, (seq, token) in enumerate(zip(seqs, meant, strict=True)):
            x = processed[row]
            if token is not None or not torch.isfinite(x).any():
                tokens.append(int(x.argmax()))
                continue
            weights = torch.exp((x - x.max()) / p.temperature).tolist()
            tokens.append(self.rngs[seq.seq_id].choices(range(VOCAB_SIZE), weights=weights)[0])
        return tokens

    def _result(self, req: Request, seq: Sequence, token: int) -> SampleResult:
        p = req.params
        result = SampleResult(seq, token)
        if p.logprobs is not None:
            result.logprob = _LOGPROBS.get(token, -20.0)
            result.rank = 1 + sum(lp > result.logprob for lp in _LOGPROBS.values())
            result.top_logprobs = _RANKED[: p.logprobs]
        return result
