"""The server's request defaults from the model's generation_config.json (--generation-config auto): a field
the request leaves out takes the model's value; a field it sets wins; max_new_tokens caps max_tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

HTTP = httpx.Client(timeout=30)
MSG = [{"role": "user", "content": "hello there"}]


def _completion(server, **body):
    response = HTTP.post(server.url + "/v1/completions", json={"prompt": "abc", **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_omitted_fields_take_the_models_defaults(fake_server):
    plain = fake_server()
    greedy_model = fake_server(sampling_defaults={"temperature": 0.0, "max_tokens": 5})
    greedy = _completion(plain, temperature=0, max_tokens=5)["choices"][0]["text"]
    # the model's temperature 0 applies to a request that sets none: the greedy text, every time
    assert [_completion(greedy_model)["choices"][0]["text"] for _ in range(3)] == [greedy] * 3
    # without the model's default the same request samples at temperature 1 (seeded: it differs)
    assert _completion(plain, max_tokens=5, seed=1)["choices"][0]["text"] != greedy
    # a request's own temperature wins over the model's
    assert _completion(greedy_model, temperature=1.0, seed=1)["choices"][0]["text"] == \
        _completion(plain, max_tokens=5, seed=1)["choices"][0]["text"]


def test_the_models_max_new_tokens_caps_max_tokens(fake_server):
    server = fake_server(sampling_defaults={"max_tokens": 4})
    for body in ({}, {"max_tokens": 10}):
        assert _completion(server, **body)["usage"]["completion_tokens"] == 4
    chat = HTTP.post(server.url + "/v1/chat/completions", json={"messages": MSG}).json()
    assert chat["usage"]["completion_tokens"] == 4 and chat["choices"][0]["finish_reason"] == "length"
    assert _completion(fake_server(), max_tokens=10)["usage"]["completion_tokens"] == 10
