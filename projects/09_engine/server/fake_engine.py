"""A tiny, deterministic stand-in for `kernel_lab.engine.LLMEngine`: the same surface
(`kernel_lab.engine.interface.Engine`), the same SamplingParams and the same requests, outputs and output
processor (detokenisation, stop conditions, deltas), with a fake model and a fake KV pool in place of the
scheduler and the runner. So the server's tests exercise every path (queues, aborts, stop strings, n > 1,
seeds, logprobs, KV accounting) in milliseconds, without a model, against the engine's own rules.

The "model" is a character-level language: a token is one printable ASCII character (ids 3..97) plus
three specials (0 pad, 1 bos, 2 eos). Greedy decoding spells out a fixed sentence starting at an offset
derived from the context, so the text is predictable enough to aim stop strings at; sampling draws from a
small fixed distribution with a per-sequence `random.Random(seed)`.
"""

from __future__ import annotations

import math
import random
import threading
import time
import zlib
from dataclasses import dataclass, field

from kernel_lab.engine.block_manager import blocks_needed
from kernel_lab.engine.errors import RequestFieldError
from kernel_lab.engine.interface import EngineStats
from kernel_lab.engine.output_processor import OutputProcessor
from kernel_lab.engine.outputs import RequestOutput
from kernel_lab.engine.sampler import SampleResult
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
        self.grammar_service = None    # no grammar engine: structured outputs are refused with a 400

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
        self.ids.add(request_id)
        request = Request(request_id, prompt if isinstance(prompt, str) else None, ids, params, arrival=0)
        self.output_processor.add_request(request)
        self.offsets[request_id] = zlib.crc32(bytes(i % 256 for i in ids)) % len(SENTENCE)
        self.rngs.update((seq.seq_id, _seq_rng(seq)) for seq in request.seqs)
        self.blocks[request_id] = 0
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> None:
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
        return bool(self.waiting or self.running)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
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
        outputs = []
        for req in list(self.running):
            need = self._blocks_needed(req)
            self.free_blocks -= need - self.blocks[req.request_id]
            self.blocks[req.request_id] = need
            for seq in req.seqs:
                if not seq.is_finished:
                    self.output_processor.append_token(self._sample(req, seq))
                    self.num_generated_tokens += 1
            out = self.output_processor.make_output(req)
            if out is not None:
                outputs.append(out)
            if req.finished:
                self.running.remove(req)
                self._free(req)
        return outputs

    def _sample(self, req: Request, seq: Sequence) -> SampleResult:
        p = req.params
        pos = seq.num_output_tokens
        if self.eos_after is not None and pos >= self.eos_after and not p.ignore_eos:
            token = EOS
        elif p.greedy and self.script is not None:
            token = ord(self.script[pos]) - FIRST_CHAR + 3 if pos < len(self.script) else EOS
        elif p.greedy:
            token = ord(SENTENCE[(self.offsets[req.request_id] + pos) % len(SENTENCE)]) - FIRST_CHAR + 3
        else:
            weights = [math.exp(lp / p.temperature) for lp in _LOGPROBS.values()]
            token = self.rngs[seq.seq_id].choices(list(_LOGPROBS), weights=weights)[0]
        result = SampleResult(seq, token)
        if p.logprobs is not None:
            result.logprob = _LOGPROBS.get(token, -20.0)
            result.rank = 1 + sum(lp > result.logprob for lp in _LOGPROBS.values())
            result.top_logprobs = _RANKED[: p.logprobs]
        return result
