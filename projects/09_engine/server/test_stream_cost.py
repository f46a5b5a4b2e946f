"""A long stream costs each step the same: the engine's output processor cuts each step's delta once, the
server forwards it, and nothing along the way copies what was already sent. Measured as the memory each step
allocates (tracemalloc's peak over the step), which grows with the stream's length exactly when something
copies the cumulative text, token ids or logprobs."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import tracemalloc

import pytest

pytest.importorskip("fastapi")

from kernel_lab.server.async_engine import AsyncEngine  # noqa: E402
from kernel_lab.server.protocol import CompletionRequest  # noqa: E402
from kernel_lab.server.serving_completion import CompletionServing  # noqa: E402

fake_engine = sys.modules["kernel_lab_server_tests_fake_engine"]  # loaded by this directory's conftest
NUM_TOKENS = 2000
WINDOW = 200


async def _stream_step_costs() -> tuple[list[int], str]:
    engine = fake_engine.FakeEngine(max_model_len=NUM_TOKENS + 64)
    async_engine = AsyncEngine(lambda: engine)
    async_engine.engine, async_engine.state = engine, "ready"
    serving = CompletionServing(async_engine)
    body = CompletionRequest(prompt="hello", stream=True, max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True,
                             logprobs=2, stop=["never seen"], stream_options={"include_usage": True})
    created = asyncio.ensure_future(serving.create(body, raw=None))   # it waits for the engine's admission
    while async_engine._commands.empty():
        await asyncio.sleep(0)
    verdicts: list = []
    async_engine._apply(engine, async_engine._commands.get_nowait(), verdicts)  # the engine thread's "add"
    assert not any(isinstance(item, BaseException) for _, item in verdicts)
    async_engine._deliver(verdicts)
    events = (await created).body_iterator
    costs, text = [], []
    tracemalloc.start()
    try:
        while engine.has_unfinished_requests():
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            # One step as the engine thread runs it, then the handler turning it into an SSE event.
            async_engine._deliver(async_engine._forward(engine.step(), time.monotonic()))
            event = await events.__anext__()
            costs.append(tracemalloc.get_traced_memory()[1] - before)
            (choice,) = json.loads(event[len("data: "):])["choices"]
            assert len(choice["logprobs"]["tokens"]) == 1, "each event carries only the step's new token"
            text.append(choice["text"])
    finally:
        tracemalloc.stop()
    usage = json.loads((await events.__anext__())[len("data: "):])["usage"]
    assert usage["completion_tokens"] == NUM_TOKENS
    return costs, "".join(text)


def test_a_2000_token_stream_costs_each_step_the_same():
    costs, text = asyncio.run(_stream_step_costs())
    assert len(costs) == NUM_TOKENS and len(text) == NUM_TOKENS
    early, late = sum(costs[WINDOW:2 * WINDOW]), sum(costs[-WINDOW:])
    # Amortised list growth is allowed for; copying the cumulative output each step would cost ~20x here.
    assert late <= 2 * early + (64 << 10), f"steps 1800-2000 allocated {late} B, steps 200-400 {early} B"

