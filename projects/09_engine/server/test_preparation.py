"""Request preparation off the event loop (kernel_lab/server/preparation.py) and the size bounds checked
before it: /health answers while a request is tokenized or rendered, a 10 MB prompt is refused before
tokenizing, the pool refuses work past its bound, and tools and schemas are bounded in size."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from kernel_lab.server.preparation import PreparationPool  # noqa: E402
from kernel_lab.server.protocol import MAX_SPEC_CHARS, MAX_TOOLS, APIError  # noqa: E402

HTTP = httpx.Client(timeout=60)
MSG = [{"role": "user", "content": "hello there"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SLOW_S = 2.5  # how long the slowed tokenizer holds one request


def _health_latency(url: str) -> float:
    start = time.perf_counter()
    assert HTTP.get(url + "/health").status_code == 200
    return time.perf_counter() - start


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2}),
    ("/tokenize", {"prompt": "hello"}),
    ("/tokenize", {"messages": MSG}),
])
def test_health_answers_while_a_request_is_tokenized(fake_server, path, body):
    server = fake_server()
    tokenizer = server.engine.tokenizer
    entered = threading.Event()

    def slowed(method):
        def slow(*args, **kwargs):
            entered.set()
            time.sleep(SLOW_S)  # a huge prompt's tokenization, or a heavy template
            return method(*args, **kwargs)
        return slow

    tokenizer.encode = slowed(tokenizer.encode)
    tokenizer.apply_chat_template = slowed(tokenizer.apply_chat_template)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(HTTP.post, server.url + path, json=body)
        assert entered.wait(10)
        latency = _health_latency(server.url)
        assert not pending.done()  # /health answered while the request was still being prepared
        assert pending.result().status_code == 200
    assert latency < 1.0, f"/health took {latency:.2f} s while a request was tokenized"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x" * 10_000_000, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "x" * 10_000_000], "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 10_000_000}]}, "messages"),
    ("/tokenize", {"prompt": "x" * 10_000_000}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x" * 10_000_000}]}, "messages"),
])
def test_a_10_mb_prompt_is_refused_before_tokenizing_and_health_answers_meanwhile(fake_server, path, body, param):
    server = fake_server()
    calls = []
    tokenizer = server.engine.tokenizer
    tokenizer.encode = lambda *a, _encode=tokenizer.encode, **k: calls.append(1) or _encode(*a, **k)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(HTTP.post, server.url + path, json=body)
        latencies = []
        while not pending.done():
            latencies.append(_health_latency(server.url))
        response = pending.result()
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert "characters" in response.json()["error"]["message"]
    assert calls == [] or path == "/v1/completions"  # only the short prompt of the list was tokenized
    assert max(latencies, default=0) < 2.0
    limit = server.engine.config.max_model_len * tokenizer.max_token_chars  # the bound is exact at its edge
    ok = HTTP.post(server.url + "/tokenize", json={"prompt": "x" * limit, "add_special_tokens": False})
    assert ok.status_code == 200 and ok.json()["count"] == limit
    over = HTTP.post(server.url + "/tokenize", json={"prompt": "x" * (limit + 1)})
    assert over.status_code == 400 and over.json()["error"]["param"] == "prompt"


def test_the_pool_refuses_work_past_its_bound_until_a_job_ends():
    pool = PreparationPool(max_workers=1, max_pending=2)
    release = threading.Event()

    async def scenario():
        first = asyncio.ensure_future(pool.run(release.wait, 10))
        second = asyncio.ensure_future(pool.run(lambda: "queued"))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as refused:
            await pool.run(lambda: "refused")
        assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
        second.cancel()  # a queued job whose client went away never runs: its slot is free again
        await asyncio.sleep(0.05)
        third = asyncio.ensure_future(pool.run(lambda: "third"))
        first.cancel()  # a running one keeps its thread, and its slot, until it ends
        await asyncio.sleep(0.05)
        with pytest.raises(APIError):
            await pool.run(lambda: "refused")
        release.set()
        assert await third == "third"
        return await pool.run(lambda: "after")

    try:
        assert asyncio.run(scenario()) == "after"
    finally:
        release.set()
        pool.shutdown()


@pytest.mark.parametrize("body, param", [
    ({"messages": MSG, "tools": [TOOL] * (MAX_TOOLS + 1)}, "tools"),
    ({"messages": MSG, "tools": [{**TOOL, "function": {"name": "f", "description": "d" * 300_000}}]}, "tools"),
    ({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "description": "d" * MAX_SPEC_CHARS}}}}, "response_format"),
    ({"messages": MSG, "guided_regex": "a" * (MAX_SPEC_CHARS + 1)}, "guided_regex"),
    ({"messages": MSG, "guided_choice": ["a" * 1000] * 70}, "guided_choice"),
])
def test_tools_and_schemas_are_bounded_in_count_and_size(fake_server, body, param):
    server = fake_server()
    response = HTTP.post(server.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    tools = HTTP.post(server.url + "/tokenize", json={"messages": MSG, "tools": [TOOL] * (MAX_TOOLS + 1)})
    assert tools.status_code == 400 and tools.json()["error"]["param"] == "tools"


def test_a_grammar_wait_holds_a_slot_and_never_cancels_the_shared_compile():
    from concurrent.futures import Future

    pool = PreparationPool(max_workers=1, max_pending=1)
    compile_result: Future = Future()  # the grammar service's cached future, shared by every request

    async def scenario():
        waiting = asyncio.ensure_future(pool.wait(compile_result))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError):
            await pool.run(lambda: "refused")  # the wait counts against the bound
        waiting.cancel()  # its client went away
        await asyncio.sleep(0.05)
        assert not compile_result.cancelled()
        compile_result.set_result("grammar")
        await asyncio.sleep(0.05)
        return await pool.wait(compile_result)

    try:
        assert asyncio.run(scenario()) == "grammar"
    finally:
        pool.shutdown()
