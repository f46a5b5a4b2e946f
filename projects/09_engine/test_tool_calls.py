"""Tool calls (kernel_lab/engine/tool_calls.py): the Hermes parser, whole and streamed, and the specs that
force `tool_choice`. The grammar-forced outputs of the real tokenizer are tested in test_structured_output.py."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from kernel_lab.engine.tool_calls import (
    ForcedToolParser,
    HermesToolParser,
    tool_calls_finish_reason,
    tool_choice_spec,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}

TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": 3, '
        '"nested": {"a": [1, {"b": "]"}]}}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"zone": "CET"}}\n</tool_call>')


def counter_ids():
    ids = (f"call_{i}" for i in itertools.count())
    return lambda: next(ids)


def collect(deltas):
    """Reassemble streamed deltas the way an OpenAI client does."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert call["id"] is None, "id sent twice"
                call["id"], call["name"] = tc["id"], tc["function"]["name"]
            else:
                assert call["name"] is not None, "arguments before the name"
            call["arguments"] += tc["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def stream_in_pieces(text, sizes, stream=None):
    stream = stream or HermesToolParser(counter_ids())
    deltas, i = [], 0
    for size in itertools.cycle(sizes):
        if i >= len(text):
            break
        deltas += stream.feed(text[i:i + size])
        i += size
    return deltas + stream.finish(), stream


def test_whole_output_splits_into_content_and_calls():
    content, calls = HermesToolParser(counter_ids()).parse(TEXT)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"])["city"] == 'Pa"ris}'
    assert calls[0]["id"] == "call_0" and calls[0]["type"] == "function"
    assert HermesToolParser().parse("no calls here") == ("no calls here", [])


def test_unparsable_blocks_stay_content_and_an_unterminated_last_call_counts():
    content, calls = HermesToolParser().parse("a <tool_call>not json</tool_call> b")
    assert calls == [] and content == "a <tool_call>not json</tool_call> b"
    content, calls = HermesToolParser().parse('<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    _, calls = HermesToolParser().parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"x": 1}'  # arguments already a string: kept


@pytest.mark.parametrize("sizes", [[1], [2], [3, 1, 7], [5], [11], [len(TEXT)]])
def test_streamed_deltas_reassemble_to_the_whole_parse(sizes):
    deltas, stream = stream_in_pieces(TEXT, sizes)
    content, calls = collect(deltas)
    _, whole = HermesToolParser().parse(TEXT)
    assert content.strip() == "Let me check."
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    for got, want in zip(calls, whole):
        assert json.loads(got["arguments"]) == json.loads(want["function"]["arguments"])
    assert [c["function"]["arguments"] for c in stream.tool_calls] == [c["arguments"] for c in calls]


def test_random_splits_never_leak_tags_into_content():
    rng = random.Random(0)
    for _ in range(50):
        sizes = [rng.randint(1, 9) for _ in range(20)]
        content, calls = collect(stream_in_pieces(TEXT, sizes)[0])
        assert "<" not in content and len(calls) == 2


def test_arguments_stream_before_the_call_ends():
    stream = HermesToolParser(counter_ids())
    deltas = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Pa'


def test_held_back_text_that_is_not_a_tag_is_content():
    deltas, _ = stream_in_pieces("a < b <tool and <tool_cal", [3])
    assert collect(deltas)[0] == "a < b <tool and <tool_cal"


def test_name_after_arguments_is_parsed_when_the_call_closes():
    text = '<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>'
    content, calls = collect(stream_in_pieces(text, [4])[0])
    assert content == "" and calls[0]["name"] == "get_time" and json.loads(calls[0]["arguments"]) == {"zone": "UTC"}
    content, calls = collect(stream_in_pieces("<tool_call>oops</tool_call>", [4])[0])
    assert content == "<tool_call>oops</tool_call>" and calls == []


def test_tool_choice_specs():
    assert tool_choice_spec([WEATHER], "auto") is None and tool_choice_spec([WEATHER], "none") is None
    named = tool_choice_spec([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named.kind == "json" and json.loads(named.value) == TIME["function"]["parameters"]
    required = json.loads(tool_choice_spec([WEATHER, TIME], "required").value)
    assert required["minItems"] == 1 and len(required["items"]["anyOf"]) == 2
    single = json.loads(tool_choice_spec([WEATHER], "required", parallel_tool_calls=False).value)
    assert single["maxItems"] == 1 and single["items"]["properties"]["name"] == {"type": "string",
                                                                                 "enum": ["get_weather"]}


@pytest.mark.parametrize("tools, choice, pattern", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice names the function 'nope'"),
    ([WEATHER], "always", "tool_choice must be"),
    ([WEATHER], {"type": "function"}, "tool_choice must be"),
    ([], "required", "tools must be a non-empty list"),
    ([{"type": "function", "function": {}}], "required", r"tools\[0\] must be"),
    ([WEATHER, WEATHER], "required", r"tools\[1\].function.name 'get_weather' is given twice"),
])
def test_bad_tool_choices_name_the_field(tools, choice, pattern):
    with pytest.raises(ValueError, match=pattern):
        tool_choice_spec(tools, choice)


def test_forced_outputs_become_tool_calls_whole_and_streamed():
    named = {"type": "function", "function": {"name": "get_time"}}
    calls = ForcedToolParser(named, counter_ids()).parse('{"zone": "CET"}')[1]
    assert calls == [{"id": "call_0", "type": "function", "function": {"name": "get_time",
                                                                      "arguments": '{"zone": "CET"}'}}]
    _, streamed = collect(stream_in_pieces('{"zone": "CET"}', [2], ForcedToolParser(named, counter_ids()))[0])
    assert streamed == [{"id": "call_0", "name": "get_time", "arguments": '{"zone": "CET"}'}]
    text = '[{"name": "get_weather", "parameters": {"city": "]}"}}, {"name": "get_time", "parameters": {"zone": "X"}}]'
    _, whole = ForcedToolParser("required").parse(text)
    for sizes in ([1], [4, 9], [len(text)]):
        _, streamed = collect(stream_in_pieces(text, sizes, ForcedToolParser("required"))[0])
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole]


def test_finish_reason_is_tool_calls_after_a_call():
    assert tool_calls_finish_reason([{"id": "x"}], "stop") == "tool_calls"
    assert tool_calls_finish_reason([], "stop") == "stop"
    assert tool_calls_finish_reason([{"id": "x"}], "length") == "length"


# A valid output for each kind of `parameters` schema a forced call may have: any JSON value.
FORCED_SCHEMAS = {
    "object": ({"type": "object", "properties": {"q": {"type": "string"}}}, {"q": "a } ] \" b"}),
    "any": ({}, {"free": [1, {"x": None}]}),
    "integer": ({"type": "integer"}, 42),
    "string": ({"type": "string"}, 'say "}"'),
    "array": ({"type": "array", "items": {"type": "number"}}, [1.5, -2]),
    "nested": ({"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "array", "items": {"type": "object"}}}}}}, {"a": {"b": [{}, {"c": "]"}]}}),
}


def forced_output(kind: str, choice) -> str:
    _, value = FORCED_SCHEMAS[kind]
    if choice == "required":
        return json.dumps([{"name": "f", "parameters": value}, {"name": "g", "parameters": value}])
    return json.dumps(value)


def streamed_answer(text: str, choice, sizes) -> tuple[str, list]:
    deltas, _ = stream_in_pieces(text, sizes, ForcedToolParser(choice, counter_ids()))
    content, calls = collect(deltas)
    return content.strip(), [(c["name"], c["arguments"]) for c in calls]


@pytest.mark.parametrize("kind", sorted(FORCED_SCHEMAS))
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_forced_calls_streamed_equal_whole_for_every_schema_and_every_cut(kind, choice):
    schema, value = FORCED_SCHEMAS[kind]
    tools = [{"type": "function", "function": {"name": n, "parameters": schema}} for n in ("f", "g")]
    assert tool_choice_spec(tools, choice) is not None  # a schema the forcing grammar takes
    text = forced_output(kind, choice)
    content, calls = ForcedToolParser(choice).parse(text)
    names = ["f", "g"] if choice == "required" else ["f"]
    assert content is None and [c["function"]["name"] for c in calls] == names
    assert all(json.loads(c["function"]["arguments"]) == value for c in calls)
    rng = random.Random(kind)
    for cut in range(len(text) + 1):  # a stop string, a length cut or a grammar rejection ends it anywhere
        prefix = text[:cut]
        content, calls = ForcedToolParser(choice, counter_ids()).parse(prefix)
        whole = ((content or ""), [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
        for sizes in ([1], [rng.randint(1, 7) for _ in range(5)], [max(cut, 1)]):
            assert streamed_answer(prefix, choice, sizes) == whole, (prefix, sizes)
        if choice == "required":
            assert all(json.loads(arguments) == value for _, arguments in whole[1])  # only complete calls
        elif _parses(prefix):  # a prefix of a scalar may be a whole value ("4" of 42)
            assert whole == ("", [("f", json.dumps(json.loads(prefix)))])
        else:
            assert whole == (prefix.strip(), []), prefix


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def test_a_cut_required_array_keeps_its_complete_calls_and_the_rest_is_content():
    text = forced_output("object", "required")
    cut = text.index('{"name": "g"') + 5
    content, calls = ForcedToolParser("required").parse(text[:cut])
    assert [c["function"]["name"] for c in calls] == ["f"] and content == ', {"nam'
    content, calls = ForcedToolParser("required").parse('[{"name": "f", "param')
    assert calls == [] and content == '[{"name": "f", "param'
