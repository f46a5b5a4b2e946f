"""A tiny, deterministic stand-in for `kernel_lab.engine.LLMEngine` (the same add_request / abort_request /
step / stats interface and the same outputs, `kernel_lab.engine.outputs`), so the server's tests can exercise
every path (queues, aborts, stop strings, n > 1, seeds, logprobs, KV accounting) in milliseconds and without
a model.

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
from dataclasses import dataclass

from kernel_lab.engine.outputs import CompletionOutput, RequestOutput

PAD, BOS, EOS = 0, 1, 2
FIRST_CHAR, LAST_CHAR = 32, 126  # printable ASCII
VOCAB_SIZE = 3 + (LAST_CHAR - FIRST_CHAR + 1)
SENTENCE = "the quick brown fox jumps over the lazy dog. "


class FakeTokenizer:
    eos_token_ids = {EOS}
    vocab_size = VOCAB_SIZE

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

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text)


@dataclass
class FakeSamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]


# Fixed candidate distribution for sampling: characters of the sentence, the first the most likely.
_CANDIDATES = sorted(set(SENTENCE))
_LOGITS = [-(i % 7) * 0.5 for i in range(len(_CANDIDATES))]
_LOGZ = math.log(sum(math.exp(x) for x in _LOGITS))
_LOGPROBS = {ord(c) - FIRST_CHAR + 3: lg - _LOGZ for c, lg in zip(_CANDIDATES, _LOGITS, strict=False)}


class _Seq:
    def __init__(self, index: int, params: FakeSamplingParams, context_key: int):
        self.index = index
        self.rng = random.Random((params.seed if params.seed is not None else random.getrandbits(32)) + index)
        self.offset = context_key % len(SENTENCE)
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.cumulative = 0.0
        self.text = ""
        self.reported_text = ""
        self.reported_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason = None


class _Request:
    def __init__(self, request_id, prompt, prompt_ids, params):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        key = zlib.crc32(bytes(i % 256 for i in prompt_ids))
        self.seqs = [_Seq(i, params, key) for i in range(params.n)]
        self.blocks = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class FakeEngine:
    """Deterministic engine with the LLMEngine surface. `step_delay_s` makes steps slow, and `gate`
    (a threading.Event, set by default) pauses stepping while cleared, for queue-full and disconnect
    tests. `eos_after` makes greedy sequences end with EOS after that many tokens (None: never)."""

    def __init__(
        self,
        model=None,
        max_model_len: int = 256,
        max_num_seqs: int = 8,
        block_size: int = 4,
        num_kv_blocks: int = 512,
        step_delay_s: float = 0.0,
        eos_after: int | None = None,
        load_delay_s: float = 0.0,
        fail_load: str | None = None,
        **_ignored,
    ):
        if load_delay_s:
            time.sleep(load_delay_s)
        if fail_load:
            raise RuntimeError(fail_load)
        self.tokenizer = FakeTokenizer()
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.free_blocks = num_kv_blocks
        self.step_delay_s = step_delay_s
        self.eos_after = eos_after
        self.gate = threading.Event()
        self.gate.set()
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self.ids: set[str] = set()
        self.aborted: list[str] = []
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.steps = 0

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt, params: FakeSamplingParams) -> None:
        if request_id in self.ids:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        if any(not 0 <= t < VOCAB_SIZE for t in ids):
            raise ValueError("prompt token id out of range")
        self.ids.add(request_id)
        self.waiting.append(_Request(request_id, prompt if isinstance(prompt, str) else None, ids, params))

    def abort_request(self, request_id: str) -> None:
        for queue in (self.waiting, self.running):
            for req in list(queue):
                if req.request_id == request_id:
                    queue.remove(req)
                    self.free_blocks += req.blocks
                    req.blocks = 0
                    self.ids.discard(request_id)
                    self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict:
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_kv_blocks_total": self.num_kv_blocks,
            "num_kv_blocks_free": self.free_blocks,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "num_preemptions": 0,
        }

    # ---------------------------------------------------------------- stepping
    def _blocks_needed(self, req: _Request) -> int:
        longest = max(len(s.token_ids) for s in req.seqs) + 1
        return req.params.n * -(-(len(req.prompt_ids) + longest) // self.block_size)

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
            req.blocks = need
            self.prefix_queries += len(req.prompt_ids)
            self.prefix_hits += len(req.prompt_ids) // 2
            self.running.append(req)
        outputs = []
        for req in list(self.running):
            need = self._blocks_needed(req)
            self.free_blocks -= need - req.blocks
            req.blocks = need
            for seq in req.seqs:
                if seq.finish_reason is None:
                    self._advance(req, seq)
            outputs.append(self._output(req))
            if req.finished:
                self.running.remove(req)
                self.free_blocks += req.blocks
                req.blocks = 0
                self.ids.discard(req.request_id)
        return outputs

    def _advance(self, req: _Request, seq: _Seq) -> None:
        p = req.params
        pos = len(seq.token_ids)
        if self.eos_after is not None and pos >= self.eos_after and not p.ignore_eos:
            token = EOS
        elif p.temperature == 0:
            token = ord(SENTENCE[(seq.offset + pos) % len(SENTENCE)]) - FIRST_CHAR + 3
        else:
            weights = [math.exp(lp / p.temperature) for lp in _LOGPROBS.values()]
            token = seq.rng.choices(list(_LOGPROBS), weights=weights)[0]
        logprob = _LOGPROBS.get(token, -20.0)
        seq.token_ids.append(token)
        seq.cumulative += logprob
        if p.logprobs is not None:
            top = dict(sorted(_LOGPROBS.items(), key=lambda kv: -kv[1])[: p.logprobs])
            top[token] = logprob
            seq.logprobs.append(top)
        if token == EOS:
            seq.finish_reason = "stop"
            return
        seq.text = self.tokenizer.decode(seq.token_ids)
        if p.stop_token_ids and token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            return
        for s in p.stop or []:
            at = seq.text.find(s)
            if at >= 0:
                seq.text = seq.text[:at]
                seq.finish_reason, seq.stop_reason = "stop", s
                return
        if len(seq.token_ids) >= p.max_tokens or len(req.prompt_ids) + len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"

    def _output(self, req: _Request) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            new_ids = seq.token_ids[seq.reported_tokens :]
            new_text = seq.text[len(seq.reported_text) :] if seq.text.startswith(seq.reported_text) else ""
            seq.reported_tokens, seq.reported_text = len(seq.token_ids), seq.text
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.text,
                    token_ids=list(seq.token_ids),
                    cumulative_logprob=seq.cumulative,
                    logprobs=list(seq.logprobs) if req.params.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    new_token_ids=new_ids,
                    new_text=new_text,
                )
            )
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_ids), outs, req.finished)
