"""One request cannot hurt another, through the server (issue 31): the issue's request (a stop token id
past the vocabulary) is a 400 naming `stop_token_ids`, streamed or not, before any response began, and the
server serves the next request; add_request's TypeError is a 400 and its other failures a 500 for that
request alone, never EngineDead; and on the real engine, a fault injected into one request of a running
batch is a 500 for it while the requests beside it get 200 with their usual text and /health stays ok."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

HTTP = httpx.Client(timeout=120)
ISSUE_REQUEST = {"prompt": "Hello", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [1000000000]}


def _completion(server, body, headers=None):
    return HTTP.post(server.url + "/v1/completions", json=body, headers=headers or {})


@pytest.mark.parametrize("stream", [False, True])
def test_the_issues_request_is_a_400_naming_the_field_and_the_server_goes_on(fake_server, stream):
    server = fake_server()
    rsp = _completion(server, {**ISSUE_REQUEST, "stream": stream})
    assert rsp.status_code == 400, rsp.text     # streamed too: the engine refused it before the stream began
    error = rsp.json()["error"]
    assert error["param"] == "stop_token_ids" and "1000000000" in error["message"]
    assert _completion(server, {"prompt": "Hello", "max_tokens": 4}).status_code == 200
    assert HTTP.get(server.url + "/health").json() == {"status": "ok"}
    server.wait_idle()


@pytest.mark.parametrize("raised,status,code", [(TypeError("prompt holds a float"), 400, None),
                                                (RuntimeError("the request broke add_request"), 500,
                                                 "request_failed")])
def test_add_request_failures_end_that_request_alone(fake_server, monkeypatch, raised, status, code):
    server = fake_server()
    real_add = server.engine.add_request

    def add_request(request_id, prompt, params=None):
        if params.max_tokens == 3:          # the marked request
            raise raised
        real_add(request_id, prompt, params)

    monkeypatch.setattr(server.engine, "add_request", add_request)
    rsp = _completion(server, {"prompt": "Hello", "max_tokens": 3})
    assert rsp.status_code == status and rsp.json()["error"]["code"] == code, rsp.text
    assert HTTP.get(server.url + "/health").status_code == 200
    assert _completion(server, {"prompt": "Hello", "max_tokens": 4}).status_code == 200


@pytest.fixture
def faulty_detokenizer(live_server, monkeypatch):
    """Requests whose prompt starts with "POISON" fail in the detokenizer after their first token."""
    engine = live_server.engine
    marker = engine.tokenizer.encode("POISON")
    real_append = engine.output_processor.append_token

    def append_token(result):
        request = result.seq.request
        if request.prompt_token_ids[:len(marker)] == marker and result.seq.num_output_tokens >= 1:
            raise RuntimeError("injected detokenizer fault")
        real_append(result)

    monkeypatch.setattr(engine.output_processor, "append_token", append_token)


def test_a_fault_in_one_running_request_is_a_500_for_it_alone(live_server, faulty_detokenizer):
    headers = {"Authorization": f"Bearer {live_server.api_key}"}
    ordinary = [{"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
                for p in ("The capital of France is", "Once upon a time", "1, 2, 3,")]
    alone = [_completion(live_server, body, headers).json()["choices"][0]["text"] for body in ordinary]
    poison = {"prompt": "POISON pill", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda body: _completion(live_server, body, headers),
                                 ordinary + [poison, {**poison, "stream": True}]))
    bad, bad_stream = together[3], together[4]
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "request_failed", bad.text
    events = [json.loads(line[6:]) for line in bad_stream.text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "request_failed"     # in-band: the stream had begun
    assert [r.status_code for r in together[:3]] == [200] * 3
    assert [r.json()["choices"][0]["text"] for r in together[:3]] == alone
    assert HTTP.get(live_server.url + "/health").json() == {"status": "ok"}
    stats = live_server.wait_idle(30)
    assert stats["kv_cache_blocks_free"] == stats["kv_cache_blocks_total"]


def test_a_fault_of_the_whole_step_still_fails_everything_and_health_says_so(fake_server, monkeypatch):
    server = fake_server()

    def broken_step():
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(server.engine, "step", broken_step)
    rsp = _completion(server, {"prompt": "Hello", "max_tokens": 3})
    assert rsp.status_code == 500 and rsp.json()["error"]["code"] == "engine_dead", rsp.text
    health = HTTP.get(server.url + "/health")
    assert health.status_code == 500 and "the device fell over" in health.json()["error"]
    assert _completion(server, {"prompt": "Hello", "max_tokens": 3}).status_code == 500
