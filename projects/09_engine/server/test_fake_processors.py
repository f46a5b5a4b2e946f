"""The fake engine runs the engine's own logits processors and grammar service, so the fast server tests
(test_fuzz.py's sweeps among them) reach the faults that live there. Each check here fails if the fake
went back to ignoring a control: the outputs below are impossible for the fake's unprocessed model, which
greedily spells "the quick brown fox jumps over the lazy dog. " from a prompt-dependent offset."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
httpx = pytest.importorskip("httpx")

HTTP = httpx.Client(timeout=30)
MSG = [{"role": "user", "content": "hello there"}]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}


def _complete(server, **body) -> dict:
    rsp = HTTP.post(server.url + "/v1/completions", json={"prompt": "hello", "temperature": 0, **body})
    assert rsp.status_code == 200, rsp.text
    return rsp.json()["choices"][0]


def _char_id(server, char: str) -> int:
    (token,) = server.engine.tokenizer.encode(char, add_special_tokens=False)
    return token


def test_allowed_token_ids_logit_bias_and_bad_words_change_the_fake_output(fake_server):
    server = fake_server()
    assert _complete(server, max_tokens=6, allowed_token_ids=[_char_id(server, "z")])["text"] == "zzzzzz"
    assert _complete(server, max_tokens=6, logit_bias={str(_char_id(server, "q")): 100})["text"] == "qqqqqq"
    free = _complete(server, max_tokens=40)["text"]
    banned = _complete(server, max_tokens=40, bad_words=["o"])["text"]
    assert "o" in free and "o" not in banned


def test_min_tokens_holds_back_the_fake_models_eos(fake_server):
    server = fake_server(eos_after=2)
    assert len(_complete(server, max_tokens=10)["text"]) == 2
    held = _complete(server, max_tokens=10, min_tokens=5)
    assert len(held["text"]) >= 5, held


def test_structured_outputs_are_compiled_and_enforced_on_the_fake(fake_server):
    server = fake_server()
    choice = _complete(server, max_tokens=20, guided_choice=["yes", "no"])
    assert choice["text"] in ("yes", "no") and choice["finish_reason"] == "stop"
    sampled = _complete(server, max_tokens=20, temperature=0.9, seed=3, structured_outputs={"regex": "[a-c]{4}x"})
    assert re.fullmatch("[a-c]{4}x", sampled["text"]), sampled
    assert json.loads(_complete(server, max_tokens=40, guided_json=CITY)["text"]) == {"city": "Paris"}
    bad = HTTP.post(server.url + "/v1/completions", json={"prompt": "x", "guided_regex": "(unclosed"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex", bad.text
    server.wait_idle()
    assert server.engine.structured_outputs.waiting == []


def test_a_forced_tool_call_is_generated_by_the_grammar_on_the_fake(fake_server):
    server = fake_server()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
    rsp = HTTP.post(server.url + "/v1/chat/completions", json={
        "messages": MSG, "temperature": 0, "max_tokens": 40, "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    choice = rsp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", rsp.text
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_response_format_json_schema_is_strict_by_default_on_the_fake(fake_server):
    """Issue 31 item 5: without `strict`, main compiled a non-strict grammar and the fake added a key."""
    server = fake_server()
    rsp = HTTP.post(server.url + "/v1/chat/completions", json={
        "messages": MSG, "temperature": 0, "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}})
    choice = rsp.json()["choices"][0]
    assert choice["finish_reason"] == "stop", rsp.text
    assert json.loads(choice["message"]["content"]) == {"city": "Paris"}, rsp.text
