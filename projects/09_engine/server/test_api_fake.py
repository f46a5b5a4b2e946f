"""The HTTP API against the deterministic fake engine: every route, parameter and error status, stream
versus non-stream, disconnects, queue limits and metrics. Milliseconds per request; the same behaviour
is then checked against the real model in test_live.py."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from kernel_lab.engine.output_processor import stop_holdback  # noqa: E402

MSG = [{"role": "user", "content": "hello there"}]
# One client for the module: building an httpx client (its SSL context) costs more than a request.
HTTP = httpx.Client(timeout=30)


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ----------------------------------------------------------------------------- unit: delta hold-back
def test_stop_holdback_is_the_longest_partial_stop_suffix():
    assert stop_holdback("abc lazy do", ["dog"]) == 2
    assert stop_holdback("abc l", ["lazy", "xyz"]) == 1
    assert stop_holdback("abc la", ["lazy", "a"]) == 2
    assert stop_holdback("abc", ["lazy"]) == 0
    assert stop_holdback("abc", []) == 0


class _ByteTokenizer:
    """Token = one UTF-8 byte, so a character can arrive in pieces."""

    eos_token_ids: set[int] = set()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def _deltas(text: str, stops: list[str]) -> list[str]:
    """The text deltas the engine's output processor emits, one byte-token at a time."""
    from kernel_lab.engine.output_processor import OutputProcessor
    from kernel_lab.engine.sampler import SampleResult
    from kernel_lab.engine.sampling_params import RequestOutputKind, SamplingParams
    from kernel_lab.engine.sequence import Request

    request = Request("r", None, [ord("x")], SamplingParams(stop=stops or None, max_tokens=None,
                                                           output_kind=RequestOutputKind.DELTA), arrival=0)
    processor = OutputProcessor(_ByteTokenizer(), max_model_len=10_000, finish=lambda seq: None)
    processor.add_request(request)
    deltas = []
    for byte in text.encode():
        processor.append_token(SampleResult(request.seqs[0], byte))
        deltas.append(processor.make_output(request).outputs[0].text)
    return deltas


def test_deltas_never_show_a_partial_stop_or_partial_character():
    # Formerly a property of the server's cursor; the engine's output processor is now the only place.
    deltas = _deltas("one lat", ["lazy"])
    assert "".join(deltas[:6]) == "one " and deltas[5] == "" and deltas[6] == "lat"
    deltas = _deltas("late é", [])
    assert deltas[-2] == "" and deltas[-1] == "é" and "".join(deltas) == "late é"


# ----------------------------------------------------------------------------- completions
def test_completion_greedy_text_usage_and_shape(fake_server):
    server = fake_server()
    client = server.client()
    out = client.completions.create(model="fake-model", prompt="hello", max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.model == "fake-model" and out.id.startswith("cmpl-")
    (choice,) = out.choices
    prompt_ids = server.engine.tokenizer.encode("hello")
    assert len(choice.text) == 12 and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == 12
    assert out.usage.total_tokens == len(prompt_ids) + 12
    again = client.completions.create(model="fake-model", prompt="hello", max_tokens=12, temperature=0)
    assert again.choices[0].text == choice.text


def test_completion_default_max_tokens_is_16_and_model_is_optional(fake_server):
    server = fake_server()
    rsp = HTTP.post(server.url + "/v1/completions", json={"prompt": "abc", "temperature": 0})
    assert rsp.status_code == 200
    assert rsp.json()["usage"]["completion_tokens"] == 16


def test_completion_token_id_prompts_batch_of_prompts_and_n(fake_server):
    server = fake_server()
    client = server.client()
    tok = server.engine.tokenizer
    prompts = [tok.encode("first prompt"), tok.encode("second")]
    out = client.completions.create(model="fake-model", prompt=prompts, max_tokens=5, n=3, temperature=0.8, seed=7)
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert out.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert out.usage.completion_tokens == 6 * 5
    texts = {c.index: c.text for c in out.choices}
    assert len({texts[0], texts[1], texts[2]}) > 1, "n samples of one prompt should differ"


def test_completion_echo_and_stop(fake_server):
    server = fake_server()
    client = server.client()
    out = client.completions.create(
        model="fake-model", prompt="the quick", max_tokens=60, temperature=0, echo=True, stop=["lazy"]
    )
    choice = out.choices[0]
    assert choice.text.startswith("the quick")
    assert "lazy" not in choice.text[len("the quick") :]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == "lazy"


def test_completion_logprobs(fake_server):
    server = fake_server()
    out = server.client().completions.create(model="fake-model", prompt="x", max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert token_lp <= 0 and len(top) == 3
        assert max(top.values()) >= token_lp - 1e-9


# ----------------------------------------------------------------------------- chat
def test_chat_greedy_seeded_and_logprobs(fake_server):
    server = fake_server()
    client = server.client()
    out = client.chat.completions.create(
        model="fake-model", messages=MSG, max_completion_tokens=9, temperature=0, logprobs=True, top_logprobs=2
    )
    assert out.object == "chat.completion"
    choice = out.choices[0]
    assert choice.message.role == "assistant" and len(choice.message.content) == 9
    assert len(choice.logprobs.content) == 9
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    a = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=20, temperature=1.0, seed=3)
    b = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=20, temperature=1.0, seed=3)
    c = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=20, temperature=1.0, seed=4)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != c.choices[0].message.content


def test_chat_default_max_tokens_fills_the_context(fake_server):
    server = fake_server(max_model_len=64)
    out = server.client().chat.completions.create(model="fake-model", messages=MSG, temperature=0)
    prompt = out.usage.prompt_tokens
    assert out.usage.completion_tokens == 64 - prompt and out.choices[0].finish_reason == "length"


def test_chat_eos_finishes_with_stop(fake_server):
    server = fake_server(eos_after=5)
    out = server.client().chat.completions.create(model="fake-model", messages=MSG, temperature=0, max_tokens=50)
    assert out.choices[0].finish_reason == "stop" and len(out.choices[0].message.content) == 5
    assert out.usage.completion_tokens == 6  # five characters and the EOS token


# ----------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("n", [1, 3])
def test_stream_equals_non_stream_with_stops_and_usage(fake_server, route, n):
    server = fake_server(step_delay_s=0.001)
    client = server.client()
    common = dict(
        model="fake-model", max_tokens=30, temperature=0.0 if n == 1 else 0.9, seed=11, n=n, stop=["over the", "dog"]
    )
    if route == "chat":
        full = client.chat.completions.create(messages=MSG, **common)
        stream = client.chat.completions.create(
            messages=MSG, stream=True, stream_options={"include_usage": True}, **common
        )
    else:
        full = client.completions.create(prompt="fox", **common)
        stream = client.completions.create(prompt="fox", stream=True, stream_options={"include_usage": True}, **common)
    texts, reasons, usage, roles = {}, {}, None, 0
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        assert chunk.usage is None
        for ch in chunk.choices:
            if route == "chat":
                roles += ch.delta.role == "assistant"
                piece = ch.delta.content or ""
            else:
                piece = ch.text
            texts[ch.index] = texts.get(ch.index, "") + piece
            if ch.finish_reason:
                assert ch.index not in reasons, "a choice finished twice"
                reasons[ch.index] = ch.finish_reason
    for choice in full.choices:
        expected = choice.message.content if route == "chat" else choice.text
        assert texts[choice.index] == expected
        assert reasons[choice.index] == choice.finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    if route == "chat":
        assert roles == n


def test_stream_wire_format_ends_with_done(fake_server):
    server = fake_server()
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 4, "stream": True}
    ) as rsp:
        assert rsp.status_code == 200
        assert rsp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(rsp)
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert "usage" not in events[0]  # only with stream_options.include_usage


def test_client_disconnect_aborts_and_frees_kv(fake_server):
    server = fake_server(step_delay_s=0.01)
    fake = server.engine
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={"prompt": "abc", "max_tokens": 5000 // 20, "stream": True, "ignore_eos": True},
    ) as rsp:
        for i, _ in enumerate(rsp.iter_lines()):
            if i >= 6:
                break
    stats = server.wait_idle(10)
    assert fake.aborted, "the engine never saw an abort"
    assert stats["request_success"]["abort"] == 1
    assert fake.free_blocks == fake.num_kv_blocks


def test_non_stream_disconnect_aborts(fake_server):
    server = fake_server(step_delay_s=0.02)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 200, "ignore_eos": True}, timeout=0.3
        )
    server.wait_idle(10)
    assert server.engine.aborted and server.engine.free_blocks == server.engine.num_kv_blocks
    # and the handler itself ended (it is not left waiting on a stream that will never speak again)
    tasks = server.background.server.server_state.tasks
    deadline = time.monotonic() + 10
    while tasks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not tasks


# ----------------------------------------------------------------------------- errors
def expect_error(rsp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert rsp.status_code == status, rsp.text
    error = rsp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "temperature": -0.5}, "temperature"),
        ({"prompt": "x", "temperature": 2.5}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "stop": [""]}, None),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
        ({"prompt": "x", "logit_bias": {"100000": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
        ({"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
        ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format.type"),
        ({"prompt": "x", "structured_outputs": {"json": 3}}, "structured_outputs.json"),
        ({"prompt": "x", "logprobs_for_prompt": 1}, "logprobs_for_prompt"),
        ({"prompt": "x", "unknown_field": 1}, "unknown_field"),
        ({"prompt": []}, None),
        ({"prompt": [[]]}, None),
        ({"prompt": [-1]}, None),
        ({"prompt": [10**6]}, "prompt"),
        ({"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "echo"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "prompt_logprobs"),  # the fake has no model to score with
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({}, "prompt"),
    ],
)
def test_completion_bad_parameters_are_400(fake_server, body, param):
    server = fake_server()
    expect_error(HTTP.post(server.url + "/v1/completions", json=body), 400, param)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, None),
        ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": MSG, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": MSG, "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, None),
    ],
)
def test_chat_bad_parameters_are_400(fake_server, body, param):
    server = fake_server()
    expect_error(HTTP.post(server.url + "/v1/chat/completions", json=body), 400, param)


def test_malformed_json_and_wrong_body_type_are_400(fake_server):
    server = fake_server()
    headers = {"content-type": "application/json"}
    error = expect_error(HTTP.post(server.url + "/v1/completions", content=b'{"prompt": "x",', headers=headers), 400)
    assert "JSON" in error["message"]
    expect_error(HTTP.post(server.url + "/v1/completions", content=b"[1, 2]", headers=headers), 400)
    expect_error(HTTP.post(server.url + "/v1/chat/completions", content=b"\xff\xfe", headers=headers), 400)


def test_prompt_over_context_is_400(fake_server):
    server = fake_server(max_model_len=32)
    long = "y" * 40
    error = expect_error(HTTP.post(server.url + "/v1/completions", json={"prompt": long}), 400)
    assert "maximum context length" in error["message"]
    error = expect_error(
        HTTP.post(server.url + "/v1/completions", json={"prompt": "y" * 20, "max_tokens": 20}), 400, "max_tokens"
    )
    assert "32" in error["message"]
    long_chat = [{"role": "user", "content": "z" * 40}]
    expect_error(HTTP.post(server.url + "/v1/chat/completions", json={"messages": long_chat}), 400, "messages")
    # without an explicit max_tokens the default is capped to what fits
    ok = HTTP.post(server.url + "/v1/completions", json={"prompt": "y" * 20})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 32 - 21


def test_unknown_model_is_404_and_unknown_route_is_openai_shaped(fake_server):
    server = fake_server()
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-9", prompt="x", max_tokens=1)
    expect_error(HTTP.get(server.url + "/v1/nothing-here"), 404)
    expect_error(HTTP.get(server.url + "/v1/models/other"), 404)
    expect_error(HTTP.get(server.url + "/v1/completions"), 405)


def test_api_key_required_on_v1_only(fake_server):
    server = fake_server(api_key="sekret")
    assert HTTP.get(server.url + "/health").status_code == 200
    assert HTTP.get(server.url + "/metrics").status_code == 200
    expect_error(HTTP.get(server.url + "/v1/models"), 401)
    expect_error(HTTP.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    expect_error(HTTP.post(server.url + "/v1/completions", json={"prompt": "x"}), 401)
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["fake-model"]


def test_starting_server_answers_503_then_200(fake_server):
    server = fake_server(wait=False, load_delay_s=1.0)
    assert HTTP.get(server.url + "/health").status_code == 503
    error = expect_error(HTTP.post(server.url + "/v1/completions", json={"prompt": "x"}), 503)
    assert error["code"] == "model_loading"
    assert HTTP.get(server.url + "/metrics").status_code == 200
    server.wait_ready(10)
    assert HTTP.get(server.url + "/health").status_code == 200


def test_engine_that_fails_to_load_reports_500(fake_server):
    server = fake_server(wait=False, fail_load="weights are corrupt", load_delay_s=0.01)
    server.async_engine.ready_event.wait(10)
    assert HTTP.get(server.url + "/health").status_code == 500
    expect_error(HTTP.post(server.url + "/v1/completions", json={"prompt": "x"}), 500)


def test_full_waiting_queue_is_429_with_retry_after(fake_server, read_metrics):
    server = fake_server(max_waiting=4)
    server.engine.gate.clear()  # the engine stops stepping: every admitted request stays waiting
    results: list[int] = []

    def send():
        rsp = HTTP.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        results.append(rsp.status_code)

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while server.async_engine.num_waiting < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    rsp = HTTP.post(server.url + "/v1/completions", json={"prompt": "x"})
    error = expect_error(rsp, 429)
    assert int(rsp.headers["Retry-After"]) >= 1 and error["code"] == "rate_limit_exceeded"
    with pytest.raises(openai.RateLimitError):
        server.client().chat.completions.create(model="fake-model", messages=MSG)
    server.engine.gate.set()
    for t in threads:
        t.join(30)
    assert results == [200] * 4
    # room again
    assert HTTP.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    assert read_metrics(server.url)[("kernel_lab_request_rejected_total", (("reason", "queue_full"),))] == 2


# ----------------------------------------------------------------------------- models, health, metrics
def test_models_and_health(fake_server):
    server = fake_server()
    data = HTTP.get(server.url + "/v1/models").json()
    assert data["object"] == "list" and data["data"][0]["id"] == "fake-model"
    assert data["data"][0]["max_model_len"] == server.engine.config.max_model_len
    assert HTTP.get(server.url + "/v1/models/fake-model").json()["id"] == "fake-model"
    assert HTTP.get(server.url + "/health").json() == {"status": "ok"}


def test_metrics_parse_and_agree_with_requests(fake_server, read_metrics):
    server = fake_server(step_delay_s=0.002)
    client = server.client()
    completion_tokens = prompt_tokens = 0
    for i in range(5):
        out = client.completions.create(model="fake-model", prompt="p" * (i + 1), max_tokens=3 + i, temperature=0)
        completion_tokens += out.usage.completion_tokens
        prompt_tokens += out.usage.prompt_tokens
    server.wait_idle()
    values = read_metrics(server.url)
    assert values[("kernel_lab_request_success_total", (("finished_reason", "length"),))] == 5
    assert values[("kernel_lab_request_generation_tokens_total", ())] == completion_tokens
    assert values[("kernel_lab_request_prompt_tokens_total", ())] == prompt_tokens
    assert values[("kernel_lab_time_to_first_token_seconds_count", ())] == 5
    assert values[("kernel_lab_e2e_request_latency_seconds_count", ())] == 5
    assert values[("kernel_lab_inter_token_latency_seconds_count", ())] == completion_tokens - 5
    assert values[("kernel_lab_kv_cache_usage_perc", ())] == 0.0
    assert values[("kernel_lab_num_requests_running", ())] == 0
    assert values[("kernel_lab_avg_generation_throughput_toks_per_s", ())] > 0
    assert 0 < values[("kernel_lab_prefix_cache_hit_rate", ())] <= 1
    buckets = [v for (name, labels), v in values.items() if name == "kernel_lab_e2e_request_latency_seconds_bucket"]
    assert max(buckets) == 5 and buckets == sorted(buckets)


def test_the_fake_and_the_real_engine_share_one_surface():
    from kernel_lab.engine import LLMEngine
    from kernel_lab.engine.interface import Engine

    fake_engine = sys.modules["kernel_lab_server_tests_fake_engine"]  # loaded by this directory's conftest
    assert isinstance(fake_engine.FakeEngine(), Engine)
    tiny = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}
    assert isinstance(LLMEngine(tiny, max_model_len=32, max_num_seqs=2, device="cpu"), Engine)
