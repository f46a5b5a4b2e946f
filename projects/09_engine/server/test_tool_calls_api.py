"""Tool calling through /v1/chat/completions on the fake engine with a scripted model (the bundled 135M
model cannot be trusted to choose tools): `auto` parses Hermes blocks into tool_calls, whole and streamed
(OpenAI's delta shapes), with finish_reason "tool_calls"; history with assistant tool_calls and `tool`
messages renders; tool_choice naming an unknown function, or without tools, is a 400."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MSG = [{"role": "user", "content": "weather in Paris?"}]
HTTP = httpx.Client(timeout=30)


def _chat(server, **body):
    return HTTP.post(server.url + "/v1/chat/completions", json={"messages": MSG, "temperature": 0, **body})


def test_auto_parses_a_hermes_call_whole_and_streamed(fake_server):
    server = fake_server(script="Checking. " + CALL)
    choice = _chat(server, tools=TOOLS).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["message"]["content"] == "Checking."

    events = []
    with HTTP.stream("POST", server.url + "/v1/chat/completions",
                     json={"messages": MSG, "temperature": 0, "tools": TOOLS, "stream": True}) as rsp:
        for line in rsp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    deltas = [c["delta"] for e in events for c in e["choices"]]
    pieces = [t for d in deltas for t in d.get("tool_calls", [])]
    assert pieces[0]["id"].startswith("call_") and pieces[0]["type"] == "function" and pieces[0]["index"] == 0
    assert pieces[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert json.loads("".join(p["function"].get("arguments", "") for p in pieces)) == {"city": "Paris"}
    assert "".join(d.get("content") or "" for d in deltas).strip() == "Checking."
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "<tool_call>" not in "".join(d.get("content") or "" for d in deltas)


def test_tool_choice_none_leaves_the_text_and_history_with_tool_messages_renders(fake_server):
    server = fake_server(script=CALL)
    choice = _chat(server, tools=TOOLS, tool_choice="none").json()["choices"][0]
    assert choice["message"]["content"] == CALL and choice["finish_reason"] == "stop"
    history = MSG + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    rsp = HTTP.post(server.url + "/v1/chat/completions", json={"messages": history, "tools": TOOLS,
                                                               "parallel_tool_calls": True, "store": False,
                                                               "metadata": {"a": "b"}, "user": "u",
                                                               "service_tier": "auto"})
    assert rsp.status_code == 200, rsp.text


@pytest.mark.parametrize("body,param", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
])
def test_bad_tool_choice_is_400(fake_server, body, param):
    rsp = _chat(fake_server(), **body)
    assert rsp.status_code == 400 and rsp.json()["error"]["param"] == param, rsp.text


def test_tokenize_and_detokenize_in_vllms_shapes(fake_server):
    server = fake_server()
    out = HTTP.post(server.url + "/tokenize", json={"prompt": "abc"}).json()
    assert out["tokens"] == server.engine.tokenizer.encode("abc") and out["count"] == 4
    assert out["max_model_len"] == 256 and out["token_strs"] is None
    chat = HTTP.post(server.url + "/tokenize", json={"messages": MSG, "tools": TOOLS}).json()
    assert chat["tokens"] == server.engine.tokenizer.apply_chat_template(MSG, tools=TOOLS)
    back = HTTP.post(server.url + "/detokenize", json={"tokens": out["tokens"][1:]}).json()
    assert back == {"prompt": "abc"}
    for path, body, param in (("/tokenize", {}, "prompt"), ("/detokenize", {"tokens": [10**6]}, "tokens"),
                              ("/tokenize", {"prompt": "x", "model": "other"}, "model")):
        rsp = HTTP.post(server.url + path, json=body)
        assert rsp.status_code in (400, 404) and rsp.json()["error"]["param"] == param, rsp.text


def test_chat_template_flag_reads_a_file_or_the_text(tmp_path):
    from kernel_lab.server.launch import ChatTemplateError, read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert read_chat_template(str(path)) == path.read_text()
    assert read_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    assert read_chat_template(None) is None
    inline = "{% for m in messages %}" + "{{ m.content }} " * 40 + "{% endfor %}"  # > 255 bytes, no "/"
    assert len(inline) > 255 and read_chat_template(inline) == inline
    missing = str(tmp_path / "no_such_file.jinja")
    for spec, reason in ((missing, "No such file"), ("x" * 300, "too long"), (str(tmp_path), "directory")):
        with pytest.raises(ChatTemplateError, match="cannot be read") as info:
            read_chat_template(spec)
        assert spec in str(info.value) and reason in str(info.value)


def test_serve_with_a_missing_chat_template_exits_at_start_up(tmp_path, capsys):
    pytest.importorskip("uvicorn")
    from kernel_lab.cli import main

    missing = str(tmp_path / "no_such_file.jinja")
    assert main(["serve", "--chat-template", missing, "--port", "0"]) == 2
    assert missing in capsys.readouterr().err


def test_a_replacement_chat_template_is_compiled_when_set(bundled_model):
    from kernel_lab.models.loader import resolve_model_dir
    from kernel_lab.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_directory(resolve_model_dir(None))
    tokenizer.apply_chat_template([{"role": "user", "content": "warm the model's own template"}])
    tokenizer.set_chat_template("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"
    with pytest.raises(ValueError, match="does not parse"):
        tokenizer.set_chat_template("{% for m in messages %}")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"
