"""Nothing a request leaves behind outlives it (issue 31, item 7), on the real engine (the bundled SmolLM2,
fp32 on CPU): 1,000 requests of every kind (plain, n > 1, stop strings, a grammar, refused at add_request,
aborted while queued, aborted while running, a client leaving its stream early), through the engine and then
through the AsyncEngine, leave no Request or Sequence alive (so no grammar matcher, output state or
detokenizer either), no entry in the engine's, the scheduler's, the grammar manager's or the AsyncEngine's
tables, and every KV block free. Also: the metrics' throughput window is trimmed as it is appended to, and
the engine counts requests, not sequences, as running and waiting (vLLM)."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import weakref

import pytest

from kernel_lab.engine import LLMEngine, SamplingParams
from kernel_lab.engine.errors import RequestFieldError
from kernel_lab.engine.sampling_params import RequestOutputKind
from kernel_lab.engine.structured_output import make_spec

pytestmark = pytest.mark.usefixtures("one_cpu_thread", "reference_only")

PROMPTS = ["Hi", "The", "1, 2,", "Once", "A cat"]
NUM_REQUESTS = 1000


@pytest.fixture(scope="module")
def engine(bundled_model):
    return LLMEngine(None, dtype="float32", device="cpu", weights="float32", max_model_len=64, max_num_seqs=64,
                     num_kv_blocks=160, max_num_batched_tokens=256, block_size=16)


def _params(i: int, delta: bool = False) -> SamplingParams:
    kind = {"output_kind": RequestOutputKind.DELTA} if delta else {}
    choice = i % 8
    if choice == 1:
        return SamplingParams(n=2, max_tokens=2, temperature=0.7, seed=i, **kind)
    if choice == 2:
        return SamplingParams(max_tokens=3, stop=[" ", "e"], temperature=0, **kind)
    if choice == 3 and xgrammar_available():
        return SamplingParams(max_tokens=3, structured_outputs=make_spec("choice", ["yes", "no"], "guided_choice"),
                              **kind)
    if choice == 4:
        return SamplingParams(max_tokens=2, stop_token_ids=[10**9], **kind)   # refused by verify
    return SamplingParams(max_tokens=1 + i % 2, temperature=0, **kind)


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def _assert_engine_idle(engine) -> None:
    assert not engine.requests and not engine.has_unfinished_requests()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.structured_outputs.waiting
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_cache_blocks_free"] == stats["kv_cache_blocks_total"]


class _Tracker:
    """Weak references to every Request and Sequence the engine made: after the run none may be alive."""

    def __init__(self, engine):
        self.refs: list[weakref.ref] = []
        self._engine = engine

    def saw(self, request_id: str) -> None:
        request = self._engine.requests.get(request_id)
        if request is not None:
            self.refs += [weakref.ref(request)] + [weakref.ref(s) for s in request.seqs]

    def alive(self) -> list:
        gc.collect()
        return [ref() for ref in self.refs if ref() is not None]


def test_a_thousand_requests_with_aborts_leave_nothing_in_the_engine(engine):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    tracker, refused, aborted = _Tracker(engine), 0, 0
    for i in range(NUM_REQUESTS):
        rid = f"e{i}"
        try:
            engine.add_request(rid, rng.choice(PROMPTS), _params(i))
        except RequestFieldError:
            refused += 1
            continue
        tracker.saw(rid)
        if i % 8 == 5:                       # aborted before it ran
            engine.abort_request(rid)
            aborted += 1
        if i % 32 == 31:
            engine.step()
            running = [r for r in engine.requests if engine.requests[r].seqs[0].num_output_tokens]
            for victim in running[:2]:       # aborted while running
                engine.abort_request(victim)
                aborted += 1
    while engine.has_unfinished_requests():
        engine.step()
    assert refused == NUM_REQUESTS // 8 and aborted > NUM_REQUESTS // 8
    _assert_engine_idle(engine)
    assert tracker.alive() == []


def test_a_thousand_requests_through_the_async_engine_leave_nothing_behind(engine):
    from kernel_lab.server.async_engine import AsyncEngine, RequestRejected

    tracker = _Tracker(engine)
    original_add = engine.add_request

    def add_and_track(request_id, prompt, params=None):
        original_add(request_id, prompt, params)
        tracker.saw(request_id)

    engine.add_request = add_and_track
    outcomes = {"done": 0, "left": 0, "rejected": 0}

    async def one(async_engine, i):
        stream = async_engine.submit(f"a{i}", engine.tokenizer.encode(PROMPTS[i % len(PROMPTS)]),
                                     _params(i, delta=True))
        try:
            await stream.admitted()
            async for out in stream:
                if i % 8 == 6:              # the client leaves after its first output
                    outcomes["left"] += 1
                    return
                if out.finished:
                    outcomes["done"] += 1
        except RequestRejected:
            outcomes["rejected"] += 1
        finally:
            stream.close()

    async def main():
        async_engine = AsyncEngine(lambda: engine, max_waiting=NUM_REQUESTS)
        async_engine.start(asyncio.get_running_loop())
        await asyncio.get_running_loop().run_in_executor(None, async_engine.ready_event.wait)
        try:
            await asyncio.gather(*(one(async_engine, i) for i in range(NUM_REQUESTS)))
            for _ in range(500):            # the aborts reach the engine thread between steps
                if not async_engine._tracked and not engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            assert async_engine.num_in_flight == 0 and async_engine.num_waiting == 0
            assert not async_engine._streams and not async_engine._tracked
            assert set(async_engine.metrics.finished) == {"stop", "length", "abort"}
        finally:
            async_engine.shutdown()
        return async_engine

    try:
        async_engine = asyncio.run(main())
    finally:
        engine.add_request = original_add
    assert outcomes["rejected"] == NUM_REQUESTS // 8 and outcomes["left"] == NUM_REQUESTS // 8
    assert sum(outcomes.values()) == NUM_REQUESTS and async_engine.state in ("stopped", "ready")
    _assert_engine_idle(engine)
    assert tracker.alive() == []


def test_the_engine_counts_requests_not_sequences(engine):
    for i in range(2):
        engine.add_request(f"n{i}", "Hello", SamplingParams(n=3, max_tokens=2))
    assert engine.stats()["num_waiting"] == 2 and engine.stats()["num_running"] == 0
    engine.step()
    assert engine.stats()["num_running"] == 2 and engine.stats()["num_waiting"] == 0
    while engine.has_unfinished_requests():
        engine.step()
    _assert_engine_idle(engine)


def test_the_throughput_window_is_trimmed_as_it_grows(monkeypatch):
    from kernel_lab.server import metrics as metrics_module

    clock = [1000.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: clock[0])
    metrics = metrics_module.ServerMetrics()
    for _ in range(5000):                   # 100 s of tokens, 50 events a second, and no /metrics scrape
        clock[0] += 0.02
        metrics.on_tokens(1, 0.02)
    window = metrics_module.THROUGHPUT_WINDOW_S
    assert len(metrics._recent) <= window / 0.02 + 1
    assert metrics.throughput()[1] == pytest.approx(50.0, rel=0.01)
