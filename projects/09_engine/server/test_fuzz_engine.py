"""Hostile-but-well-formed requests against the REAL engine: every field of /v1/completions and
/v1/chat/completions, on the bundled model (SmolLM2-135M, fp32, CPU), through the real AsyncEngine, app and
uvicorn on 127.0.0.1, with a few tokens per request.

Each example draws a body from `bodies(route, ...)` (token ids at and past the vocabulary's
edges in every field that takes ids, empty and huge values, NaN and infinities, every combination of tools,
tool_choice, response_format, guided_* and structured_outputs, stops, min_tokens, n, logprobs, streaming,
seeds, penalties, bad words) and a way to send it (read to the end, or hang up mid-answer). It asserts:
- no 5xx, and no in-band server error in a stream; every 4xx (or in-band error) in OpenAI's shape, with
  `param` naming a field of the body; a 200 well formed (choices, finish reasons, usage, logprobs, tool calls
  that parse, structured output that matches its constraint when it finished);
- a greedy request running beside it (the witness) gets the same text as alone: one request cannot hurt
  another;
- afterwards: `/health` is 200, a plain request still works, and the engine drains to idle (no request,
  no KV block, no grammar waiting, no server-side tracker left). A dead engine is restarted before the next
  example, so hypothesis can go on and shrink the failure.
At the end of each sweep `/metrics` reports an idle pool (`kv_cache_usage_perc` 0, `num_requests_running` 0).
`test_known_faults` replays the minimal bodies the sweep found (issue 31's closing note lists them).

Profiles (KERNEL_LAB_FUZZ_PROFILE):
- `ci` (default): derandomized, a fixed number of examples, the whole file in under 3 minutes on a 2-core CPU;
- `long`: random seeds, 2,600 examples and longer answers (tens of minutes: its first sweep of 400 took
  most of 11 minutes), to run by hand:
      KERNEL_LAB_FUZZ_PROFILE=long python -m pytest -q projects/09_engine/server/test_fuzz_engine.py
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("hypothesis")
pytest.importorskip("xgrammar")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PROFILE = os.environ.get("KERNEL_LAB_FUZZ_PROFILE", "ci")
if PROFILE not in ("ci", "long"):
    raise ValueError(f"KERNEL_LAB_FUZZ_PROFILE must be 'ci' or 'long', got {PROFILE!r}")
LONG = PROFILE == "long"
EXAMPLES = {"ids": 400, "structured": 400, "all": 600, "hangups": 200} if LONG else \
    {"ids": 10, "structured": 16, "all": 8, "hangups": 6}
MAX_TOKENS = (1, 2, 3, 4, 8, 16, 32) if LONG else (1, 2, 3, 4, 6)
SETTINGS = settings(
    max_examples=1, deadline=None, derandomize=not LONG, database=None, print_blob=True,
    suppress_health_check=list(HealthCheck),
)
ENGINE_KWARGS = dict(max_model_len=256, max_num_seqs=32, dtype="float32", device="cpu")
WITNESS = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
PLAIN = {"prompt": "Hello", "max_tokens": 1}
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
IDLE_TIMEOUT_S = 20.0
HTTP = httpx.Client(timeout=120)


# ================================================================================ the server
class LiveEngine:
    """A server around a real LLMEngine, restarted when an example killed it (so one fault does not fail
    every later example, and hypothesis can shrink)."""

    def __init__(self):
        self.restarts = 0
        self.background = self.async_engine = None
        self.start()
        self.witness_text = self.post("completions", WITNESS).json()["choices"][0]["text"]

    def start(self) -> None:
        from kernel_lab.engine import LLMEngine
        from kernel_lab.server.app import build_app
        from kernel_lab.server.async_engine import AsyncEngine
        from kernel_lab.server.background import BackgroundServer

        self.async_engine = AsyncEngine(lambda: LLMEngine(**ENGINE_KWARGS), max_waiting=512)
        self.background = BackgroundServer(build_app(self.async_engine)).start()
        if not self.async_engine.ready_event.wait(180) or self.async_engine.state != "ready":
            raise RuntimeError(f"the engine did not load: {self.async_engine.error!r}")
        self.model = self.engine.config.model_name
        self.vocab = self.engine.config.vocab_size

    def stop(self) -> None:
        self.background.stop()

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()

    @property
    def url(self) -> str:
        return self.background.url

    @property
    def engine(self):
        return self.async_engine.engine

    def post(self, route: str, body, **kwargs) -> httpx.Response:
        # NaN and infinities are sent as Python's json writes them: the server's parser accepts them
        return HTTP.post(self.url + ROUTES[route], content=json.dumps(body).encode(),
                         headers={"content-type": "application/json"}, **kwargs)

    def healthy(self) -> bool:
        try:
            return HTTP.get(self.url + "/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def leftovers(self) -> dict:
        """Whatever per-request state is still held (empty when idle)."""
        engine, ae = self.engine, self.async_engine
        stats = engine.stats()
        held = {
            "engine.requests": len(engine.requests), "scheduler.running": len(engine.scheduler.running),
            "scheduler.waiting": len(engine.scheduler.waiting),
            "grammar waiting": len(engine.structured_outputs.waiting),
            "kv blocks held": stats["kv_cache_blocks_total"] - stats["kv_cache_blocks_free"],
            "server streams": ae.num_in_flight, "server admission waiting": ae.num_waiting,
            "server trackers": len(getattr(ae, "_tracked", ())),
        }
        return {k: v for k, v in held.items() if v}

    def wait_idle(self) -> None:
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while (held := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not held, f"not idle {IDLE_TIMEOUT_S} s after the example: {held}"


@pytest.fixture(scope="module")
def live():
    try:
        from kernel_lab.models.gguf import default_model_path

        default_model_path()
    except Exception as exc:  # noqa: BLE001 - any reason is a reason to skip
        pytest.skip(f"the bundled model is not available: {exc!r}")
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"  # the PyTorch reference path: interpreting every kernel takes minutes
    server = LiveEngine()
    try:
        yield server
    finally:
        server.stop()
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


# ================================================================================ request bodies
def mostly(valid, edge):
    """Usually a value the server should accept, sometimes an edge it may refuse: a body with many fields
    then still reaches the engine often enough."""
    return st.integers(0, 6).flatmap(lambda i: edge if i == 6 else valid)  # one_of would weigh them 1:1


WORDS = st.sampled_from([".", "\n", "the", " the", ",", "is", "e", "I", "2"])
ODD_TEXT = st.sampled_from(["", " ", "é", "漢字", "🙂", "\x00", "\ud800", "<|im_end|>", "<|im_start|>", "a" * 300,
                            "</tool_call>", '{"'])
TEXT = mostly(WORDS, ODD_TEXT)
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf, 1e308])
SCHEMAS = [  # the first few finish in a handful of tokens, so a finished output can be checked
    {"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["a", "b"]}, {"type": "boolean"},
    {"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"]},
    {"type": "object"}, {}, True, {"type": "object", "properties": {"a": {"type": "string", "maxLength": 2}}},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
    {"type": "string", "pattern": "^[ab]{1,2}$"},
    {"$defs": {"n": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/n"}]}}, "$ref": "#/$defs/n"},
    {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(40)}},
]
BAD_SCHEMAS = [{"type": "nonsense"}, {"type": "string", "pattern": "("}, False, 3, "not json", [1]]
REGEXES = ["[ab]{1,2}", "\\d", "yes|no", ".*", "[a-c]+x"]
BAD_REGEXES = ["(unclosed", "[", "", "a{0,100000}", "\\p{L}"]
GRAMMARS = ['root ::= "yes" | "no"', 'root ::= [a-c]+']
BAD_GRAMMARS = ["root ::= root", "not a grammar", 'x ::= "a"', ""]


def schemas():
    valid = st.sampled_from(SCHEMAS)
    return mostly(valid | valid.map(json.dumps), st.sampled_from(BAD_SCHEMAS))


def token_ids(vocab: int):
    valid = st.sampled_from([0, 1, 2, vocab - 2, vocab - 1]) | st.integers(0, vocab - 1)
    return mostly(valid, st.sampled_from([vocab, vocab + 1, 2**31 - 1, 2**31, 2**63 - 1, 2**64, 10**30, -1]))


def structured_fields() -> dict:
    regex, grammar = mostly(st.sampled_from(REGEXES), st.sampled_from(BAD_REGEXES)), \
        mostly(st.sampled_from(GRAMMARS), st.sampled_from(BAD_GRAMMARS))
    choice = mostly(st.lists(WORDS, min_size=1, max_size=3), st.lists(ODD_TEXT, max_size=3))
    json_schema = st.builds(
        lambda s, strict: {"type": "json_schema", "json_schema": {"name": "x", "schema": s, **strict}},
        schemas(), st.sampled_from([{}, {"strict": True}, {"strict": False}]))
    formats = mostly(st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | json_schema,
                     st.sampled_from([{"type": "json_schema"}, {"type": "yaml"}, "text", {"type": "json_schema",
                                      "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}]))
    members = mostly(
        st.one_of(st.builds(lambda s: {"json": s}, schemas()), st.just({"json_object": True}),
                  st.builds(lambda r: {"regex": r}, regex), st.builds(lambda c: {"choice": c}, choice),
                  st.builds(lambda g: {"grammar": g}, grammar)),
        st.sampled_from([{}, {"json_object": False}, {"whitespace_pattern": " "}, {"regex": "a", "choice": ["b"]}]))
    return {"response_format": formats, "structured_outputs": members, "guided_json": schemas(),
            "guided_regex": regex, "guided_choice": choice, "guided_grammar": grammar}


def sampling_fields(vocab: int) -> dict:
    ids = token_ids(vocab)
    penalty = mostly(st.sampled_from([-2.0, -0.5, 0.0, 0.5, 1.0, 2.0]), st.sampled_from([-2.5, 2.5]) | NON_FINITE)
    return {
        "model": mostly(st.just("SmolLM2-135M-Instruct"), st.sampled_from(["other-model", ""])),
        "temperature": mostly(st.sampled_from([0, 0.0, 1e-6, 0.7, 1.0, 2.0]), st.sampled_from([-0.1, 2.1])
                              | NON_FINITE),
        "top_p": mostly(st.sampled_from([1e-9, 0.5, 0.9, 1.0]), st.sampled_from([0.0, 1.5, -1.0]) | NON_FINITE),
        "top_k": mostly(st.sampled_from([-1, 0, 1, 5, vocab]), st.sampled_from([-2, vocab + 1, 2**31, 2**63])),
        "seed": mostly(st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1]),
                       st.sampled_from([2**64, -(2**63) - 1])),
        "stop": mostly(WORDS | st.lists(WORDS, min_size=1, max_size=4),
                       ODD_TEXT | st.lists(TEXT, max_size=17) | st.just(["x" * 5000]) | st.just([])),
        "stop_token_ids": mostly(st.lists(ids, max_size=4), st.just(list(range(65)))),
        "n": mostly(st.sampled_from([1, 1, 2, 3]), st.sampled_from([0, 129])),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                               "continuous_usage_stats": st.booleans()}),
        "ignore_eos": st.booleans(),
        "presence_penalty": penalty, "frequency_penalty": penalty,
        "repetition_penalty": mostly(st.sampled_from([1e-9, 0.5, 1.0, 1.3, 2.0, 100.0]),
                                     st.sampled_from([0.0, -1.0]) | NON_FINITE),
        "logit_bias": st.dictionaries(mostly(ids.map(str), st.sampled_from(["abc", "1.5", " 5", "+5", "5_0", "٣",
                                                                              ""])),
                                      mostly(st.sampled_from([-100, 0, 1.5, 100]),
                                             st.sampled_from([-101, 101]) | NON_FINITE), max_size=3),
        "min_p": mostly(st.sampled_from([0.0, 0.05, 0.5, 1.0]), st.sampled_from([1.5, -0.1]) | NON_FINITE),
        "min_tokens": mostly(st.sampled_from([0, 1, 2, 3, 6]), st.sampled_from([10**9, -1])),
        "allowed_token_ids": mostly(st.lists(ids, min_size=1, max_size=4), st.just([])),
        "bad_words": st.lists(TEXT, max_size=3),
        "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
        **structured_fields(),
        "user": TEXT, "store": st.booleans(), "metadata": st.just({"k": "v"}), "service_tier": TEXT,
    }


def completion_fields(vocab: int, max_len: int) -> dict:
    ids = token_ids(vocab)
    prompt = mostly(
        st.sampled_from(["Hello", "The sky is", "2 + 2 =", "x"]) | st.lists(st.sampled_from(["Hi", "2 + 2 ="]),
                                                                            min_size=1, max_size=3)
        | st.lists(ids, min_size=1, max_size=6) | st.lists(st.lists(ids, min_size=1, max_size=4), min_size=1,
                                                           max_size=3),
        st.sampled_from(["", "<|im_start|>user", "a " * (max_len + 10), "\ud800", [], [[]], [[1], []],
                         list(range(1, max_len + 2))]))
    return {
        "prompt": prompt, **sampling_fields(vocab),
        "max_tokens": mostly(st.sampled_from(MAX_TOKENS), st.sampled_from([0, -1, max_len, 10**9])),
        "echo": st.booleans(), "logprobs": mostly(st.sampled_from([0, 1, 5, 20]), st.sampled_from([21, -1])),
        "best_of": st.sampled_from([1, 2, 3]), "suffix": st.sampled_from(["", "x"]),
    }


def _tool(name: str, parameters=...):
    function = {"name": name} if parameters is ... else {"name": name, "parameters": parameters}
    return {"type": "function", "function": function}


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = mostly(
    st.lists(st.builds(_tool, st.sampled_from(["get_weather", "f", "add"]),
                       st.sampled_from([..., {}, {"type": "object"}, {"type": "string"}, {"enum": [1, 2]}, CITY,
                                        CITY])),
             min_size=1, max_size=3, unique_by=lambda t: t["function"]["name"]),
    st.sampled_from([[], [{"type": "function"}], [_tool("f"), _tool("f")], [_tool("f", {"type": "nonsense"})],
                     [_tool("f", 3)], [_tool("")]]))
TOOL_CHOICE = mostly(st.sampled_from(["none", "auto", "required",
                                      {"type": "function", "function": {"name": "get_weather"}}]),
                     st.sampled_from(["sometimes", {"type": "function"},
                                      {"type": "function", "function": {"name": "missing"}}]))
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
    optional={"content": TEXT | st.just(None) | st.just([{"type": "text", "text": "hi"}]),
              "name": st.just("n"), "tool_call_id": st.just("call_1"),
              "tool_calls": st.just([{"id": "call_1", "type": "function",
                                      "function": {"name": "f", "arguments": "{}"}}])})


def chat_fields(vocab: int, max_len: int) -> dict:
    user = st.sampled_from([[{"role": "user", "content": "What is 2 + 2?"}],
                            [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]])
    messages = mostly(user, st.lists(MESSAGE, max_size=3) | st.just([{"role": "user", "content": "word " * max_len}]))
    return {
        "messages": messages, **sampling_fields(vocab),
        "max_tokens": mostly(st.sampled_from(MAX_TOKENS), st.sampled_from([0, max_len, 10**9])),
        "max_completion_tokens": mostly(st.sampled_from(MAX_TOKENS), st.sampled_from([0, 10**9])),
        "logprobs": st.booleans(), "top_logprobs": mostly(st.sampled_from([0, 1, 5, 20]), st.just(21)),
        "tools": TOOLS, "tool_choice": TOOL_CHOICE, "parallel_tool_calls": st.booleans(),
        "chat_template_kwargs": st.sampled_from([{}, {"add_generation_prompt": False}, {"tools": "x"},
                                                 {"messages": []}, {"enable_thinking": True}]),
    }


# The sweeps' focuses: the fields whose combinations reach the logits processors and the sampler, and those
# that reach the grammar and the tool-call parsers. A focused body draws most of its fields from one list,
# so a rare pair (an id past the vocabulary with min_tokens, a forced call with a stop) comes up in a few
# dozen examples instead of a few thousand.
FOCUS = {
    "ids": ("prompt", "stop_token_ids", "logit_bias", "allowed_token_ids", "min_tokens", "bad_words", "top_k",
            "seed", "n", "temperature", "ignore_eos", "skip_special_tokens", "logprobs", "top_logprobs", "echo",
            "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "top_p"),
    "structured": ("tools", "tool_choice", "parallel_tool_calls", "response_format", "structured_outputs",
                   "guided_json", "guided_regex", "guided_choice", "guided_grammar", "stop", "min_tokens", "n",
                   "stream", "logprobs", "temperature", "include_stop_str_in_output", "max_tokens"),
    "all": None,
}


@st.composite
def bodies(draw, route: str, vocab: int, max_len: int, focus: str = "all"):
    """A body for the route: its required field and a few others (so the combinations stay varied and a
    body is not refused for one of thirty fields every time), most of them from the focus."""
    fields = (completion_fields if route == "completions" else chat_fields)(vocab, max_len)
    required = "prompt" if route == "completions" else "messages"
    body = {required: draw(fields.pop(required))}
    focused = sorted(set(FOCUS[focus] or fields) & set(fields))
    names = ["tools", "tool_choice"] if route == "chat" and focus == "structured" and draw(st.booleans()) else []
    names += draw(st.lists(st.sampled_from(focused), min_size=1 if FOCUS[focus] else 0, max_size=5, unique=True))
    names += draw(st.lists(st.sampled_from(sorted(fields)), max_size=2, unique=True))
    for name in dict.fromkeys(names):
        body[name] = draw(fields[name])
    if "stream_options" in body and "stream" not in body:
        body["stream"] = True   # the options need it; without it they are a 400, which the edges cover
    return body


def bounded(body: dict, route: str) -> dict:
    """The CPU budget: a generating request gets a few tokens (a body asking for more keeps its edge value
    only where the server must refuse it before generating)."""
    body = dict(body)
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    asked = body.get(key)
    if not (isinstance(asked, int) and (asked <= 0 or asked > ENGINE_KWARGS["max_model_len"] or asked in MAX_TOKENS)):
        body[key] = MAX_TOKENS[-1]
    if route == "chat" and key == "max_completion_tokens" and "max_tokens" in body:
        body.pop("max_tokens")
    return body


# ================================================================================ what a good answer is
def field_root(param: str) -> str:
    return re.split(r"[.\[]", param, maxsplit=1)[0]


def check_error(error: dict, body: dict, where: str) -> None:
    assert isinstance(error.get("message"), str) and error["message"], f"{where}: no message: {error}"
    assert error.get("type") not in (None, "server_error"), f"{where}: {error}"
    param = error.get("param")
    assert isinstance(param, str) and param, f"{where}: the error names no field: {error}"
    assert field_root(param) in body, f"{where}: param {param!r} is not a field of the body: {error}"


def structured_constraint(body: dict):
    """(kind, value) of the constraint a finished output must satisfy, or None."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return "json_object", None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return "json", (fmt.get("json_schema") or {}).get("schema")
    so = body.get("structured_outputs") or {}
    for kind in ("json", "regex", "choice"):
        if so.get(kind) is not None:
            return kind, so[kind]
    for kind in ("json", "regex", "choice"):
        if body.get(f"guided_{kind}") is not None:
            return kind, body[f"guided_{kind}"]
    return None


def check_structured(text: str, constraint) -> None:
    kind, value = constraint
    if kind == "regex":
        assert re.fullmatch(value, text), f"{text!r} does not match the regex {value!r}"
        return
    if kind == "choice":
        assert text in value, f"{text!r} is not one of {value!r}"
        return
    parsed = json.loads(text)
    if kind == "json_object":
        assert isinstance(parsed, dict), text
        return
    schema = json.loads(value) if isinstance(value, str) else value
    jsonschema.validate(parsed, schema)
    if isinstance(schema, dict) and "properties" in schema and isinstance(parsed, dict):  # strict: xgrammar's default
        extra = set(parsed) - set(schema["properties"])
        assert not extra, f"keys the schema does not declare: {sorted(extra)} in {text!r}"


def forced_tool(body: dict) -> bool:
    return bool(body.get("tools")) and body.get("tool_choice") not in (None, "none", "auto")


def check_choice(body: dict, route: str, choice: dict) -> None:
    reason = choice["finish_reason"]
    assert reason in ("stop", "length", "tool_calls"), choice
    cut = body.get("stop") or body.get("stop_token_ids")
    if route == "chat":
        message = choice["message"]
        for call in message.get("tool_calls") or ():
            json.loads(call["function"]["arguments"])
            assert call["type"] == "function" and call["id"], call
        if forced_tool(body) and isinstance(body.get("tool_choice"), dict) and reason == "tool_calls":
            assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"], message
        text = message.get("content")
    else:
        text = choice["text"]
    constraint = structured_constraint(body)
    # allowed_token_ids may leave the grammar nothing to choose (test_known_faults holds that case)
    if constraint and reason == "stop" and not cut and not (route == "completions" and body.get("echo")) \
            and "allowed_token_ids" not in body:
        check_structured(text or "", constraint)
    wanted = body.get("logprobs")
    if route == "completions" and isinstance(wanted, int) and not body.get("echo"):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]), lp
        assert all(top is None if wanted == 0 else len(top) <= wanted for top in lp["top_logprobs"]), lp
    if route == "chat" and body.get("logprobs") and reason != "tool_calls":
        for entry in choice["logprobs"]["content"]:
            assert len(entry["top_logprobs"]) == (body.get("top_logprobs") or 0), entry


def check_whole(body: dict, route: str, payload: dict) -> list:
    prompts = body["prompt"] if route == "completions" else None
    n_prompts = len(prompts) if isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list)) else 1
    choices = payload["choices"]
    assert sorted(c["index"] for c in choices) == list(range(n_prompts * body.get("n", 1))), payload
    usage = payload["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    for choice in choices:
        check_choice(body, route, choice)
    least = body.get("min_tokens")
    free = constraint_free(body, route)
    if isinstance(least, int) and least > 0 and len(choices) == 1 and free and choices[0]["finish_reason"] == "stop":
        # nothing may stop a choice before min_tokens: not EOS, not stop_token_ids, not a stop string (vLLM)
        assert usage["completion_tokens"] >= least, f"stopped after {usage['completion_tokens']} < min_tokens"
    return sorted(choices, key=lambda c: c["index"])


def constraint_free(body: dict, route: str) -> bool:
    """No grammar ends the output (a finished grammar may stop it before min_tokens)."""
    return structured_constraint(body) is None and not (route == "chat" and forced_tool(body)) and not any(
        body.get(k) for k in ("guided_grammar", "structured_outputs"))


def read_stream(rsp: httpx.Response, body: dict, hang_up_after: int | None) -> list[dict] | None:
    events = []
    for line in rsp.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        if line == "data: [DONE]":
            return events
        event = json.loads(line[len("data: "):])
        if "error" in event:
            check_error(event["error"], body, "in-band stream error")
        events.append(event)
        if hang_up_after is not None and len(events) > hang_up_after:
            return None
    raise AssertionError(f"the stream ended without [DONE] after {len(events)} events")


def stream_texts(events: list[dict], route: str) -> dict[int, str]:
    texts = {}
    for event in events:
        for c in event.get("choices", ()):
            piece = c.get("text") if route == "completions" else (c["delta"].get("content") or "")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return texts


def stream_tool_calls(events: list[dict]) -> dict[int, list]:
    calls: dict[int, dict] = {}
    for event in events:
        for c in event.get("choices", ()):
            for piece in c.get("delta", {}).get("tool_calls") or ():
                call = calls.setdefault((c["index"], piece["index"]), {"name": "", "arguments": ""})
                call["name"] += piece.get("function", {}).get("name") or ""
                call["arguments"] += piece.get("function", {}).get("arguments") or ""
    out: dict[int, list] = {}
    for (index, _), call in sorted(calls.items()):
        out.setdefault(index, []).append((call["name"], json.loads(call["arguments"])))
    return out


def send(live: LiveEngine, route: str, body: dict, hang_up_after: int | None = None):
    """Post the body and check the answer; returns (status, whole choices or stream events), or None when
    the client hung up on purpose."""
    if body.get("stream") is True:
        with HTTP.stream("POST", live.url + ROUTES[route], content=json.dumps(body).encode(),
                         headers={"content-type": "application/json"}) as rsp:
            if rsp.status_code != 200:
                rsp.read()
                return check_status(rsp, body), None
            events = read_stream(rsp, body, hang_up_after)
            return (None if events is None else (200, events))
    try:
        rsp = live.post(route, body, timeout=0.3 if hang_up_after is not None else 120)
    except httpx.TimeoutException:
        assert hang_up_after is not None
        return None
    status = check_status(rsp, body)
    return status, (check_whole(body, route, rsp.json()) if status == 200 else None)


def check_status(rsp: httpx.Response, body: dict) -> int:
    assert rsp.status_code < 500, f"{rsp.status_code}: {rsp.text[:600]}"
    if rsp.status_code != 200:
        check_error(rsp.json()["error"], body, f"HTTP {rsp.status_code}")
    return rsp.status_code


def compare_stream(live: LiveEngine, route: str, body: dict, whole: list) -> None:
    """A greedy or seeded request streams the same text and tool calls it answers whole."""
    if not whole or body.get("echo") or body.get("n", 1) != 1:
        return
    result = send(live, route, {**{k: v for k, v in body.items() if k != "stream_options"}, "stream": True})
    assert result is not None and result[0] == 200, result
    events = result[1]
    if route == "chat" and whole[0]["message"].get("tool_calls"):
        expected = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                    for c in whole[0]["message"]["tool_calls"]]
        assert stream_tool_calls(events).get(0, []) == expected, "streamed tool calls differ from the whole answer"
        return
    text = whole[0]["message"]["content"] if route == "chat" else whole[0]["text"]
    assert stream_texts(events, route).get(0, "") == (text or ""), "the stream's text differs from the whole answer"


def reproducible(body: dict) -> bool:
    t = body.get("temperature")
    return (isinstance(t, (int, float)) and t == 0) or isinstance(body.get("seed"), int)


def run_example(live: LiveEngine, route: str, body: dict, hang_up_after: int | None = None,
                compare: bool = False) -> None:
    """One example: the body beside the witness, then the server must be healthy, serving and idle."""
    if not live.healthy():
        live.restart()
    with ThreadPoolExecutor(2) as pool:
        witness = pool.submit(live.post, "completions", WITNESS)
        try:
            result = send(live, route, body, hang_up_after)
            if compare and result is not None and result[0] == 200 and body.get("stream") is not True \
                    and reproducible(body):
                compare_stream(live, route, body, result[1])
        finally:
            witnessed = witness.result()
    assert live.healthy(), f"/health is not 200 after the example: {live.async_engine.error!r}"
    assert witnessed.status_code == 200, f"the request beside it failed: {witnessed.status_code} {witnessed.text}"
    assert witnessed.json()["choices"][0]["text"] == live.witness_text, "the request beside it changed"
    plain = live.post("completions", PLAIN)
    assert plain.status_code == 200, f"a plain request after the example: {plain.status_code} {plain.text}"
    live.wait_idle()


def check_idle_metrics(live: LiveEngine, read_metrics) -> None:
    live.wait_idle()
    from kernel_lab.server.metrics import THROUGHPUT_WINDOW_S

    # The throughput window (where the metrics keep one) must be trimmed as it grows, not only when /metrics
    # is scraped (which read_metrics below does): nothing older than the window stays.
    recent = list(getattr(live.async_engine.metrics, "_recent", ()))
    stale = [entry for entry in recent if entry[0] < time.monotonic() - THROUGHPUT_WINDOW_S - 1.0]
    assert not stale, f"{len(stale)} of {len(recent)} throughput entries are older than the window"
    values = read_metrics(live.url)
    assert values[("kernel_lab_kv_cache_usage_perc", ())] == 0.0
    assert values[("kernel_lab_num_requests_running", ())] == 0
    assert values[("kernel_lab_num_requests_waiting", ())] == 0


# ================================================================================ the sweeps
def test_every_request_field_is_fuzzed():
    """A field added to the request schemas must be added to the sweep."""
    from kernel_lab.server.protocol import ChatCompletionRequest, CompletionRequest

    for model, fields in ((CompletionRequest, completion_fields(100, 10)),
                          (ChatCompletionRequest, chat_fields(100, 10))):
        assert set(model.model_fields) == set(fields), set(model.model_fields) ^ set(fields)


@pytest.mark.parametrize("route,focus", [(r, f) for r in ROUTES for f in FOCUS
                                         if not (r == "completions" and f == "structured")])
def test_fuzzed_requests_never_hurt_the_server(live, read_metrics, route, focus):
    @settings(SETTINGS, max_examples=EXAMPLES[focus])
    @given(body=bodies(route, live.vocab, ENGINE_KWARGS["max_model_len"], focus), compare=st.booleans())
    def run(body, compare):
        run_example(live, route, bounded(body, route), compare=compare)

    run()
    check_idle_metrics(live, read_metrics)


def test_hang_ups_mid_answer_free_everything(live, read_metrics):
    """Clients that leave mid-stream or time out on a whole answer, with the same fuzzed bodies."""
    vocab, max_len = live.vocab, ENGINE_KWARGS["max_model_len"]

    @settings(SETTINGS, max_examples=EXAMPLES["hangups"])
    @given(route=st.sampled_from(sorted(ROUTES)), data=st.data(), after=st.integers(0, 3))
    def run(route, data, after):
        body = data.draw(bodies(route, vocab, max_len))
        # long enough that the client leaves while the request still runs (a finished one has nothing to free)
        body = {"ignore_eos": True, **bounded(body, route), "max_tokens": 64}
        body.pop("max_completion_tokens", None)
        run_example(live, route, body, hang_up_after=after)

    run()
    check_idle_metrics(live, read_metrics)


# ================================================================================ what the sweep found
CITY_TOOL = [_tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]})]
KNOWN_FAULTS = {
    # id: (route, the minimal body)
    "stop_token_ids_past_the_vocabulary_with_min_tokens": (
        "completions", {"prompt": "Hello", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [1000000000]}),
    "top_k_past_int32": ("completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 1, "top_k": 2**31}),
    "bad_words_with_a_lone_surrogate": ("completions", {"prompt": "Hello", "max_tokens": 2, "bad_words": ["\ud800"]}),
    "forced_tool_call_cut_by_a_stop_string": (
        "chat", {"messages": USER, "max_tokens": 12, "temperature": 0, "tools": CITY_TOOL,
                 "tool_choice": "required", "stop": ["city"]}),
    "forced_tool_call_cut_by_max_tokens_streams_like_whole": (
        "chat", {"messages": USER, "max_tokens": 3, "temperature": 0, "tools": CITY_TOOL,
                 "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    "forced_tool_call_with_non_object_parameters_streams_like_whole": (
        "chat", {"messages": USER, "max_tokens": 12, "temperature": 0, "tool_choice": "required",
                 "tools": [_tool("f", {"enum": [1, 2]})]}),
    "stop_string_before_min_tokens": (
        "completions", {"prompt": "One. Two. Three", "max_tokens": 8, "min_tokens": 6, "stop": ["."],
                        "temperature": 0}),
}


@pytest.mark.parametrize("route,body", list(KNOWN_FAULTS.values()),
                         ids=list(KNOWN_FAULTS))
def test_known_faults(live, route, body):
    run_example(live, route, body, compare=True)


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_allowed_token_ids_contradict_is_refused_naming_the_grammar(live, stream):
    """allowed_token_ids leaves the regex no legal token: the request fails naming its grammar's field (a
    finish would pass a non-matching output off as complete), and the engine serves on."""
    body = {"prompt": "Hello", "max_tokens": 3, "allowed_token_ids": [5], "guided_regex": "[ab]+"}
    run_example(live, "completions", body)
    if stream:
        lines = [line for line in live.post("completions", {**body, "stream": True}).text.splitlines()
                 if line.startswith("data: ") and line != "data: [DONE]"]
        errors = [event["error"] for event in map(json.loads, (line[6:] for line in lines)) if "error" in event]
        assert errors and errors[0]["param"] == "guided_regex", lines
    else:
        rsp = live.post("completions", body)
        assert rsp.status_code == 400 and rsp.json()["error"]["param"] == "guided_regex", rsp.text
    live.wait_idle()


def test_health_answers_while_a_10_mb_prompt_is_prepared(live):
    body = {"prompt": "word " * (2 * 1024 * 1024), "max_tokens": 1}
    waits = []
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(live.post, "completions", body)
        while not big.done():
            started = time.monotonic()
            assert HTTP.get(live.url + "/health", timeout=30).status_code == 200
            waits.append(time.monotonic() - started)
            time.sleep(0.1)
        assert big.result().status_code == 400, big.result().text[:300]
    assert max(waits) < 2.0, f"/health took up to {max(waits):.1f} s while the prompt was prepared"
    live.wait_idle()


def edge_cases(vocab: int, max_len: int) -> list[tuple[str, str, dict]]:
    """Every field that takes a token id or a count, at and past its edges (each beside min_tokens, so stop
    ids reach the logits processors): (name, route, body)."""
    past = [vocab, vocab + 1, 2**31, 2**63 - 1, 2**64, 10**30]
    at = [0, 1, 2, vocab - 1]
    ids = {
        "prompt": lambda t: {"prompt": [1, t]},
        "stop_token_ids": lambda t: {"stop_token_ids": [t]},
        "logit_bias": lambda t: {"logit_bias": {str(t): 5}},
        "allowed_token_ids": lambda t: {"allowed_token_ids": [t]},
    }
    counts = {
        "top_k": [-2, -1, 0, 1, vocab, vocab + 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63],
        "seed": [-(2**63) - 1, -(2**63), -1, 0, 2**63 - 1, 2**64 - 1, 2**64],
        "n": [0, 1, 3, 128, 129], "logprobs": [-1, 0, 20, 21], "best_of": [0, 1, 3],
        "min_tokens": [-1, 0, 3, 4, 2**31, 2**63], "max_tokens": [-1, 0, 1, max_len, 2**31, 2**63],
    }
    base = {"prompt": "Hello", "max_tokens": 3, "temperature": 0.7, "seed": 1}
    cases = [(f"{field}={t}", "completions", {**base, "min_tokens": 2, **make(t)})
             for field, make in ids.items() for t in at + past]
    cases += [(f"{field}={v}", "completions", {**base, field: v, **({"n": v} if field == "best_of" else {})})
              for field, values in counts.items() for v in values]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0.7}
    cases += [(f"chat {field}={v}", "chat", {**chat, field: v})
              for field, values in {"top_logprobs": [0, 20, 21], "max_completion_tokens": [0, 1, max_len, 2**63],
                                    "top_k": [2**31, 2**63]}.items() for v in values]
    return [(name, route, {**body, "logprobs": True} if name.startswith("chat top_logprobs") else body)
            for name, route, body in cases]


def run_batch(live: LiveEngine, cases: list[tuple[str, str, dict]], compare: bool = False) -> None:
    """All cases at once, as one batch beside the witness (one request's bad value must hurt no other);
    after a failure each case runs alone, to name the ones at fault."""
    if not live.healthy():
        live.restart()

    def one(case):
        name, route, body = case
        try:
            result = send(live, route, body)
            if compare and result is not None and result[0] == 200 and not body.get("stream"):
                compare_stream(live, route, body, result[1])
        except (AssertionError, ValueError, httpx.HTTPError) as exc:
            return f"{name}: {exc}"
        return None

    with ThreadPoolExecutor(16) as pool:
        witness = pool.submit(live.post, "completions", WITNESS)
        failures = [f for f in pool.map(one, cases) if f]
        witnessed = witness.result()
    batch_ok = live.healthy() and witnessed.status_code == 200 and \
        witnessed.json()["choices"][0]["text"] == live.witness_text
    if failures or not batch_ok:
        failures = []
        for name, route, body in cases:
            try:
                run_example(live, route, body, compare=compare)
            except (AssertionError, ValueError, httpx.HTTPError) as exc:
                failures.append(f"{name}: {str(exc)[:300]}")
    assert not failures, "\n".join(failures)


def test_every_id_and_count_field_at_its_edges(live, read_metrics):
    run_batch(live, edge_cases(live.vocab, ENGINE_KWARGS["max_model_len"]))
    check_idle_metrics(live, read_metrics)


def tool_cases() -> list[tuple[str, str, dict]]:
    """Every forced tool_choice against every kind of parameters schema and every way an answer ends early
    (a stop string inside the call, max_tokens, neither), greedy, so streamed and whole can be compared."""
    parameters = {"object": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                  "any": {}, "none given": ..., "scalar": {"enum": [1, 2]}, "array": {"type": "array",
                                                                                      "maxItems": 1}}
    ends = {"stop": {"stop": ["e"], "max_tokens": 16}, "length": {"max_tokens": 3}, "eos": {"max_tokens": 16}}
    choices = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}
    return [(f"{choice} / {kind} parameters / ends by {end}", "chat",
             {"messages": USER, "temperature": 0, "tools": [_tool("get_weather", schema)], "tool_choice": value,
              **extra})
            for choice, value in choices.items() for kind, schema in parameters.items()
            for end, extra in ends.items()]


def test_every_forced_tool_choice_and_parameters_kind_streams_like_whole(live, read_metrics):
    run_batch(live, tool_cases(), compare=True)
    check_idle_metrics(live, read_metrics)
