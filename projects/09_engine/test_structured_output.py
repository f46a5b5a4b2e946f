"""Structured outputs: request-spec parsing, xgrammar's tokenizer info from our tokenizer, the compile
service, per-sequence matchers, and outputs that always match.

The constrained sampler draws uniformly among the allowed tokens (random logits through the bitmask op:
the argmax of i.i.d. uniforms over the allowed set, i.e. temperature -> infinity), seeded, so any token the
grammar allows can appear; every output must still match the regex / choice / schema.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kernel_lab.engine.structured_output import StructuredOutputSpec, make_spec, parse_structured_output

REPO = Path(__file__).resolve().parents[2]
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", 'say "hi"']}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "address"],
}


# --- request parsing (no grammar engine) ----------------------------------------------------------------
def test_response_format_variants():
    assert parse_structured_output({"response_format": {"type": "text"}}) is None
    assert parse_structured_output({}) is None
    spec = parse_structured_output({"response_format": {"type": "json_object"}})
    assert spec.kind == "json_object" and spec.param == "response_format"
    spec = parse_structured_output({"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": NESTED_SCHEMA, "strict": True}}})
    assert spec.kind == "json" and spec.strict and json.loads(spec.value) == NESTED_SCHEMA
    assert list(json.loads(spec.value)["properties"]) == list(NESTED_SCHEMA["properties"])  # order kept
    assert spec.param == "response_format.json_schema.schema"


def test_json_schema_is_strict_unless_the_request_says_otherwise():
    def spec(**extra):
        return parse_structured_output({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object"}, **extra}}})

    assert spec().strict and spec(strict=True).strict and not spec(strict=False).strict
    for body in ({"guided_json": {"type": "object"}}, {"structured_outputs": {"json": {"type": "object"}}}):
        assert parse_structured_output(body).strict


def test_vllm_structured_outputs_and_guided_fields_agree():
    for kind, value in [("json", NESTED_SCHEMA), ("regex", r"\d+"), ("choice", ["a", "b"]),
                        ("grammar", 'root ::= "x"')]:
        new = parse_structured_output({"structured_outputs": {kind: value}})
        old = parse_structured_output({f"guided_{kind}": value})
        assert new.key == old.key and new.kind == kind
        assert new.param == f"structured_outputs.{kind}" and old.param == f"guided_{kind}"
    as_text = parse_structured_output({"guided_json": json.dumps(NESTED_SCHEMA)})
    assert as_text.key == parse_structured_output({"guided_json": NESTED_SCHEMA}).key
    assert parse_structured_output({"structured_outputs": {"json_object": True}}).kind == "json_object"


@pytest.mark.parametrize("request_body, pattern", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format, guided_regex"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "structured_outputs, guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs sets regex, choice"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, r"unknown field\(s\) \['whitespace_pattern'\]"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "json_schema.strict must be a boolean"),
    ({"guided_json": "{not json"}, "guided_json must be a JSON schema"),
    ({"guided_json": [1, 2]}, "guided_json must be a JSON schema object"),
    ({"guided_choice": []}, "guided_choice must be a non-empty list"),
    ({"guided_choice": ["a", 3]}, "guided_choice must be a non-empty list of non-empty strings"),
    ({"guided_regex": ""}, "guided_regex must be a non-empty string"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object must be true"),
])
def test_bad_requests_name_the_fields(request_body, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_structured_output(request_body)


# --- the grammar engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(bundled_model):
    from kernel_lab.models.loader import resolve_model_dir
    from kernel_lab.models.tokenizer import Tokenizer

    return Tokenizer.from_directory(resolve_model_dir(None))


@pytest.fixture(scope="module")
def service(tokenizer):
    pytest.importorskip("xgrammar")
    from kernel_lab.engine.grammar import GrammarCompileService

    svc = GrammarCompileService.for_tokenizer(tokenizer)
    yield svc
    svc.close()


def test_tokenizer_info_comes_from_our_vocabulary(tokenizer, service):
    info = service.info
    assert info.vocab_size == tokenizer.vocab_size == 49152
    assert info.stop_token_ids == sorted(tokenizer.eos_token_ids)
    assert set(info.special_token_ids) == set(tokenizer.all_special_ids) - tokenizer.eos_token_ids
    the = tokenizer.encode(" the", add_special_tokens=False)
    assert len(the) == 1 and info.decoded_vocab[the[0]] == b" the"  # byte-level "Ġthe" decoded
    from kernel_lab.engine.grammar import tokenizer_info

    wider = tokenizer_info(tokenizer, vocab_size=49152 + 64)  # an lm_head padded wider than the tokenizer
    assert wider.vocab_size == 49152 + 64 and 49152 + 10 in wider.special_token_ids


def constrained_sample(service, spec: StructuredOutputSpec, seed: int, max_tokens: int = 400,
                       matcher=None) -> list[int]:
    from kernel_lab.engine.grammar import SequenceMatcher, fill_step_bitmask
    from kernel_lab.ops import apply_token_bitmask

    matcher = matcher or SequenceMatcher(service.compile(spec))
    gen = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(max_tokens):
        bitmask, rows = fill_step_bitmask([None, matcher])  # row 0: an unconstrained request in the batch
        logits = torch.rand(2, service.vocab_size, generator=gen)
        apply_token_bitmask(logits, bitmask, rows)
        token = int(logits[1].argmax())
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            assert token in service.info.stop_token_ids
            return tokens
        tokens.append(token)
    raise AssertionError(f"no stop within {max_tokens} tokens, ending {tokens[-20:]}")


def test_regex_outputs_always_match(tokenizer, service, reference_only):
    pattern = r"[A-Z][a-z]{2,6}-\d{3}( (ok|fail))?"
    spec = make_spec("regex", pattern, "guided_regex")
    for seed in range(12):
        text = tokenizer.decode(constrained_sample(service, spec, seed), skip_special_tokens=False)
        assert re.fullmatch(pattern, text), text


def test_choice_outputs_are_one_of_the_choices(tokenizer, service, reference_only):
    choices = ["yes", "no", 'maybe "so"', "new\nline", "back\\slash"]
    spec = parse_structured_output({"structured_outputs": {"choice": choices}})
    seen = {tokenizer.decode(constrained_sample(service, spec, seed), skip_special_tokens=False)
            for seed in range(30)}
    assert seen <= set(choices) and len(seen) >= 3, seen


def test_nested_json_schema_outputs_parse_and_validate(tokenizer, service, reference_only):
    jsonschema = pytest.importorskip("jsonschema")
    spec = parse_structured_output({"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": NESTED_SCHEMA, "strict": True}}})
    for seed in range(10):
        ids = constrained_sample(service, spec, seed)
        assert not set(ids) & tokenizer.all_special_ids  # no chat token inside the JSON
        value = json.loads(tokenizer.decode(ids, skip_special_tokens=False))
        jsonschema.validate(value, NESTED_SCHEMA)
        assert list(value)[:2] == ["name", "age"]  # the schema's property order


def test_json_object_accepts_objects_only(tokenizer, service):
    # Uniform sampling inside a free JSON string almost never closes it, so this grammar is checked by
    # feeding text: any object is accepted and may stop; an array or a number may not even start.
    from kernel_lab.engine.grammar import SequenceMatcher, fill_step_bitmask

    grammar = service.compile(parse_structured_output({"response_format": {"type": "json_object"}}))
    matcher = SequenceMatcher(grammar)
    bitmask, _ = fill_step_bitmask([matcher])
    allowed = {t for t in range(service.vocab_size) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1}
    for text in ("[", "1", "\"", "{"):
        token = tokenizer.encode(text, add_special_tokens=False)[0]
        assert (token in allowed) == (text == "{"), text
    for token in tokenizer.encode('{"a": [1, {"b": null}], "c": "x"}', add_special_tokens=False):
        assert matcher.accept_token(token)
    assert matcher.is_completed() and matcher.accept_token(service.info.stop_token_ids[0])
    assert matcher.is_terminated()


def test_a_one_key_schema_without_strict_yields_only_that_key(tokenizer, service, reference_only):
    from kernel_lab.engine.grammar import SequenceMatcher, fill_step_bitmask

    one_key = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    spec = parse_structured_output({"response_format": {"type": "json_schema", "json_schema": {
        "name": "one", "schema": one_key}}})
    for seed in range(8):
        ids = constrained_sample(service, spec, seed)
        assert list(json.loads(tokenizer.decode(ids, skip_special_tokens=False))) == ["a"]
    # after the one key's value only the closing brace may follow: no comma that would open a second key
    matcher = SequenceMatcher(service.compile(spec))
    for token in tokenizer.encode('{"a": true', add_special_tokens=False):
        assert matcher.accept_token(token)
    bitmask, _ = fill_step_bitmask([matcher])
    allowed = {t for t in range(service.vocab_size) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1}
    assert tokenizer.encode("}", add_special_tokens=False)[0] in allowed
    assert tokenizer.encode(",", add_special_tokens=False)[0] not in allowed


def test_the_sampler_check_can_fail(tokenizer, service, reference_only):
    # The same sampler without the bitmask does not produce matches: the tests above are not vacuous.
    gen = torch.Generator().manual_seed(0)
    text = tokenizer.decode(torch.randint(17, service.vocab_size, (8,), generator=gen).tolist())
    assert not re.fullmatch(r"[A-Z][a-z]{2,6}-\d{3}( (ok|fail))?", text)


@pytest.mark.parametrize("kind, value, param", [
    ("json", {"type": "nonsense"}, "response_format.json_schema.schema"),
    ("json", {"type": "integer", "minimum": 5, "maximum": 1}, "guided_json"),
    ("regex", "(ab", "structured_outputs.regex"),
    ("grammar", "root ::= undefined_rule", "guided_grammar"),
    ("grammar", 'other ::= "a"', "structured_outputs.grammar"),
])
def test_values_the_engine_rejects_fail_naming_the_parameter(service, kind, value, param):
    from kernel_lab.engine.grammar import GrammarCompileError

    future = service.submit(make_spec(kind, value, param))
    with pytest.raises(GrammarCompileError, match=rf"^{re.escape(param)}: the {kind} could not be compiled: \S"):
        future.result(timeout=60)
    assert isinstance(future.exception(), ValueError)  # a 400, not a 500


def test_compiles_run_off_the_calling_thread_and_are_cached(service, monkeypatch):
    threads = []
    real = service._compile

    def recording(spec):
        threads.append(threading.current_thread().name)
        return real(spec)

    monkeypatch.setattr(service, "_compile", recording)
    spec = make_spec("regex", r"cached-[0-9]{4}", "guided_regex")
    first = service.submit(spec)
    assert service.submit(make_spec("regex", r"cached-[0-9]{4}", "structured_outputs.regex")) is first
    first.result(timeout=60)
    assert len(threads) == 1 and threads[0].startswith("kl-grammar")
    assert threads[0] != threading.current_thread().name


def test_step_bitmask_skips_unconstrained_and_terminated_rows(service):
    from kernel_lab.engine.grammar import SequenceMatcher, fill_step_bitmask

    assert fill_step_bitmask([None, None]) is None
    grammar = service.compile(make_spec("choice", ["ab"], "guided_choice"))
    done, live = SequenceMatcher(grammar), SequenceMatcher(grammar)
    for token in constrained_sample(service, make_spec("choice", ["ab"], "guided_choice"), 0) + [
            service.info.stop_token_ids[0]]:
        assert done.accept_token(token)
    assert done.is_terminated() and not live.is_terminated()
    bitmask, rows = fill_step_bitmask([live, None, done, live.fork()])
    assert rows.tolist() == [0, 3] and bitmask.shape == (2, 49152 // 32)
    assert torch.equal(bitmask[0], bitmask[1])
    assert not live.accept_token(service.info.stop_token_ids[0])  # "" is not a choice: the stop is refused


def test_a_grammar_request_waits_then_gives_one_matcher_per_sequence(service):
    import concurrent.futures

    from kernel_lab.engine.grammar import GrammarCompileError, GrammarRequest

    release = threading.Event()
    slow = concurrent.futures.ThreadPoolExecutor(1)
    spec = make_spec("regex", "[ab]{3}", "guided_regex")
    real_submit = service.submit
    service.submit = lambda s: slow.submit(lambda: (release.wait(30), real_submit(s).result())[1])
    try:
        request = GrammarRequest(service, spec)
        assert not request.ready() and request.error() is None
        with pytest.raises(RuntimeError, match="still compiling"):
            request.matcher(0)
        release.set()
        request.future.result(timeout=30)
    finally:
        del service.submit
    first, second = request.matcher(0), request.matcher(1)
    assert first is request.matcher(0) and first is not second
    assert first.accept_token(service.info.decoded_vocab.index(b"a")) and not second.is_completed()
    bad = GrammarRequest(service, make_spec("regex", "(", "guided_regex"))
    bad.future.exception(timeout=30)
    assert isinstance(bad.error(), GrammarCompileError)


def test_forked_matchers_advance_independently(tokenizer, service, reference_only):
    from kernel_lab.engine.grammar import SequenceMatcher

    spec = make_spec("choice", ["alpha", "beta", "gamma", "delta"], "guided_choice")
    parent = SequenceMatcher(service.compile(spec))
    outs = {tokenizer.decode(constrained_sample(service, spec, seed, matcher=parent.fork())) for seed in range(12)}
    assert len(outs) >= 2 and outs <= {"alpha", "beta", "gamma", "delta"}
    assert not parent.is_completed()  # the forks did not advance it


def test_cold_start_imports_no_transformers_and_is_fast(bundled_model):
    pytest.importorskip("xgrammar")
    script = """
import json, sys, time
start = time.perf_counter()
from kernel_lab.engine.grammar import GrammarCompileService
from kernel_lab.engine.structured_output import make_spec
from kernel_lab.models.loader import resolve_model_dir
from kernel_lab.models.tokenizer import Tokenizer
imported = time.perf_counter()
service = GrammarCompileService.for_tokenizer(Tokenizer.from_directory(resolve_model_dir(None)))
info = time.perf_counter()
service.compile(make_spec("json", {"type": "object", "properties": {"a": {"type": "integer"}}}, "guided_json"))
done = time.perf_counter()
no_transformers = "transformers" not in sys.modules
import transformers  # a later, real import still works
print(json.dumps({"import": imported - start, "tokenizer_info": info - imported, "first_compile": done - info,
                  "total": done - start, "no_transformers": no_transformers,
                  "real_transformers": hasattr(transformers, "__version__")}))
"""
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    times = json.loads(result.stdout.strip().splitlines()[-1])
    assert times["no_transformers"] and times["real_transformers"], times
    assert times["total"] < 10.0, times


# --- forced tool calls through the grammar ---------------------------------------------------------------
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "b": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["a", "b"]}}},
]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_always_parse_and_satisfy_their_schemas(tokenizer, service, reference_only, tool_choice):
    jsonschema = pytest.importorskip("jsonschema")
    from kernel_lab.engine.tool_calls import ForcedToolParser, tool_choice_spec

    spec = tool_choice_spec(TOOLS, tool_choice)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    names = set()
    for seed in range(8):
        ids = constrained_sample(service, spec, seed, max_tokens=600)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        _, calls = ForcedToolParser(tool_choice).parse(text)
        assert calls
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
            names.add(call["function"]["name"])
        stream, pieces = ForcedToolParser(tool_choice), []
        for k in range(1, len(ids) + 1):  # the text deltas a streaming detokenizer sends
            pieces.append(tokenizer.decode(ids[:k], skip_special_tokens=False)[len("".join(pieces)):])
        streamed = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
        assert [c["function"]["name"] for c in stream.tool_calls] == [c["function"]["name"] for c in calls]
        assert [json.loads(c["function"]["arguments"]) for c in stream.tool_calls] == [
            json.loads(c["function"]["arguments"]) for c in calls]
        assert streamed
    assert names == ({"get_weather", "add"} if tool_choice == "required" else {"add"})
