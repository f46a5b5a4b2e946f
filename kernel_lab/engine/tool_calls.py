"""Tool calls: the Hermes format for `tool_choice="auto"`, and grammar-forced calls for `required` / a named one.

One parser class per format, `HermesToolParser` and `ForcedToolParser`, serves both answers (vLLM's design:
one parser object per tool format): `feed(text delta)` returns OpenAI's streamed `delta`s and `finish()` the
last ones; `parse(text)` is the same parser fed the whole text at once, giving (content, tool_calls). So a
streamed and a non-streamed answer cannot disagree.

**Hermes** (the format Qwen2.5 / Qwen3 chat templates ask for): the model writes
`<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>`, any number of times,
with free text around. Content streams as it arrives (holding back only what could be the start of a tag),
then per call one delta with `index`, `id`, `type` and the function `name` (arguments ""), then the arguments
text in pieces as the model writes it. A block that is not a call stays content. A call cut by the end of the
output keeps the arguments written so far (its finish_reason says "length").

**Forced** (`required`, or `{"type": "function", "function": {"name": ...}}`), as vLLM does it: the output
is constrained by a JSON schema (`tool_choice_spec`): for a named function, the output *is* its arguments (any
JSON value the function's schema allows); for `required`, it is a JSON array
`[{"name": ..., "parameters": ...}, ...]` of one or more calls (one with parallel_tool_calls=False). Each call
is sent once its JSON value is complete. Generation can stop before that (a stop string, a length cut, a
grammar rejection): what did not become a complete call is then content, never an error.

Tool calls are dicts in OpenAI's shape: {"id", "type": "function", "function": {"name", "arguments"}} with
`arguments` a JSON string.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence

from .structured_output import StructuredOutputSpec, make_spec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()
_BETWEEN_CALLS = " \n\t\r[,"  # what a `required` array holds around its calls
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


# ------------------------------------------------------------------------------------------- tools and choice
def _tool_functions(tools) -> dict[str, dict]:
    """{name: parameters schema} of an OpenAI `tools` list, checked."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise ValueError("tools must be a non-empty list of {'type': 'function', 'function': {...}} objects")
    functions = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        if fn["name"] in functions:
            raise ValueError(f"tools[{i}].function.name {fn['name']!r} is given twice")
        functions[fn["name"]] = params
    return functions


def forced_function(tool_choice) -> str | None:
    """The function a `tool_choice` names (None for "none" / "auto" / "required"); ValueError if malformed."""
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if isinstance(name, str) and name:
            return name
    raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                     f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")


def tool_choice_spec(tools, tool_choice, parallel_tool_calls: bool = True) -> StructuredOutputSpec | None:
    """The structured-output spec that forces `tool_choice` (None for "none" and "auto", which are free)."""
    name = forced_function(tool_choice)
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    functions = _tool_functions(tools)
    if name is not None:
        if name not in functions:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools "
                             f"({', '.join(sorted(functions))})")
        return make_spec("json", functions[name], "tool_choice")
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": params},
              "required": ["name", "parameters"]} for n, params in functions.items()]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return make_spec("json", schema, "tools")


# ------------------------------------------------------------------------------------------- Hermes
def _call_from_json(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a whole Hermes block's JSON, or None when it is not a call."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class _CallScanner:
    """Follows one `{"name": "...", "arguments": {...}}` object as its text grows: reports the name once it
    is complete, then the arguments' text piece by piece, and where the object ends."""

    def __init__(self):
        self.text = ""
        self.name: str | None = None
        self.args_from = 0       # where the arguments value starts in `text`
        self.scanned = 0         # how far the arguments have been scanned (and sent)
        self.depth = 0
        self.in_string = self.escape = False
        self.args_done = False
        self.end: int | None = None  # index just past the object's closing brace

    def feed(self, chunk: str) -> tuple[str | None, str]:
        """(the name if it just became known, the new arguments text)."""
        self.text += chunk
        new_name = None
        if self.name is None:
            match = _HEADER.match(self.text)
            if match is None or match.end() == len(self.text) or self.text[match.end()] not in "{[":
                return None, ""
            self.name = new_name = json.loads(f'"{match.group(1)}"')
            self.args_from = self.scanned = match.end()
        start = self.scanned
        i = self.scanned
        while i < len(self.text) and not self.args_done:
            ch = self.text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.args_done = True
            i += 1
        self.scanned = i
        if self.args_done and self.end is None:
            rest = self.text[i:]
            stripped = rest.lstrip()
            if stripped.startswith("}"):
                self.end = i + (len(rest) - len(stripped)) + 1
        return new_name, self.text[start:i]

    @property
    def arguments(self) -> str:
        return self.text[self.args_from:self.scanned]


class _ToolParser:
    """What both formats share: the calls so far, the deltas that start and extend them, and the whole
    answer as the streamed one fed everything at once."""

    def __init__(self, id_factory: Callable[[], str] = new_call_id):
        self.id_factory = id_factory
        self.tool_calls: list[dict] = []  # every call started so far, arguments as streamed

    def feed(self, text: str) -> list[dict]:
        raise NotImplementedError

    def finish(self) -> list[dict]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a whole output: exactly what the streamed deltas add up to."""
        deltas = self.feed(text) + self.finish()
        content = "".join(d.get("content", "") for d in deltas).strip()
        return (content or None), self.tool_calls

    def _whole_call(self, name: str, arguments: str) -> list[dict]:
        """The one delta of a call sent at once."""
        call = tool_call(name, arguments, self.id_factory())
        self.tool_calls.append(call)
        return [{"tool_calls": [{"index": len(self.tool_calls) - 1, "id": call["id"], "type": "function",
                                 "function": {"name": name, "arguments": arguments}}]}]


class HermesToolParser(_ToolParser):
    """`<tool_call>` blocks in free text (see the module docstring)."""

    def __init__(self, id_factory: Callable[[], str] = new_call_id):
        super().__init__(id_factory)
        self._pending = ""                       # text not yet sent as content (a possible tag start)
        self._call: _CallScanner | None = None   # inside <tool_call> ... </tool_call>

    def feed(self, text: str) -> list[dict]:
        deltas: list[dict] = []
        self._pending += text
        while self._pending:
            if self._call is None:
                at = self._pending.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._pending, OPEN)
                    cut = len(self._pending) - keep
                    sent, self._pending = self._pending[:cut], self._pending[cut:]
                    if sent:
                        deltas.append({"content": sent})
                    break
                if at:
                    deltas.append({"content": self._pending[:at]})
                self._pending, self._call = self._pending[at + len(OPEN):], _CallScanner()
                continue
            close = self._pending.find(CLOSE)
            body = self._pending if close < 0 else self._pending[:close]
            if close < 0:  # hold back a possible start of </tool_call>
                keep = _partial_suffix(body, CLOSE)
                body = body[:len(body) - keep]
            self._pending = self._pending[len(body):]
            deltas += self._emit(*self._call.feed(body))
            if close < 0:
                break
            deltas += self._close_call()
            self._pending = self._pending[len(CLOSE):]
        return deltas

    def _emit(self, name: str | None, args: str) -> list[dict]:
        deltas = []
        if name is not None:
            deltas += self._whole_call(name, "")
        if args:
            self.tool_calls[-1]["function"]["arguments"] += args
            deltas.append({"tool_calls": [{"index": len(self.tool_calls) - 1, "function": {"arguments": args}}]})
        return deltas

    def _close_call(self, closed: bool = True) -> list[dict]:
        """closed: the block ended with its tag (not with the output)."""
        scanner, self._call = self._call, None
        if scanner.name is not None:
            return []
        # not in the streamable order (e.g. arguments before name): parse the whole block
        call = _call_from_json(scanner.text.strip())
        if call is None:  # not a tool call after all: it was content
            return [{"content": OPEN + scanner.text + (CLOSE if closed else "")}]
        return self._whole_call(*call)

    def finish(self) -> list[dict]:
        """Flush at the end of the output: held-back text is content; an unterminated call is closed."""
        deltas = []
        if self._call is not None:
            deltas += self._emit(*self._call.feed(self._pending))
            self._pending = ""
            if self._call.name is None:
                deltas += self._close_call(closed=False)
            self._call = None
        elif self._pending:
            deltas.append({"content": self._pending})
            self._pending = ""
        return deltas


class ForcedToolParser(_ToolParser):
    """The output of a `tool_choice_spec` grammar (named function, or required). A call is sent whole, once
    its JSON value is complete, so a cut output never leaves half a call behind: at finish() the text that
    did not become a call is content."""

    def __init__(self, tool_choice, id_factory: Callable[[], str] = new_call_id):
        super().__init__(id_factory)
        self._name = forced_function(tool_choice)
        self._text = ""
        self._consumed = 0    # required: the end of the last complete call (or of the array)
        self._closed = False  # required: the array's "]" was read

    def feed(self, text: str) -> list[dict]:
        self._text += text
        if self._name is not None or self._closed or "}" not in text:  # only a "}" can complete a call
            return []
        deltas = []
        while True:
            i = self._consumed
            while i < len(self._text) and self._text[i] in _BETWEEN_CALLS:
                i += 1
            if i < len(self._text) and self._text[i] == "]":
                self._consumed, self._closed = i + 1, True
                return deltas
            try:
                value, end = _DECODER.raw_decode(self._text, i)
            except json.JSONDecodeError:
                return deltas
            if not (isinstance(value, dict) and isinstance(value.get("name"), str) and "parameters" in value):
                return deltas  # not a call (the grammar keeps this from happening): it stays content
            deltas += self._whole_call(value["name"], json.dumps(value["parameters"], ensure_ascii=False))
            self._consumed = end

    def finish(self) -> list[dict]:
        if self._name is not None:
            try:
                value = json.loads(self._text)
            except json.JSONDecodeError:
                return [{"content": self._text}] if self._text else []
            return self._whole_call(self._name, json.dumps(value, ensure_ascii=False))
        rest = self._text[self._consumed:]
        if self._closed or (self.tool_calls and not rest.strip(_BETWEEN_CALLS + "]")):
            return []
        return [{"content": rest}] if rest else []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def tool_calls_finish_reason(tool_calls: Sequence[dict], finish_reason: str) -> str:
    """OpenAI's finish_reason: "tool_calls" when the output ended (stop) having made calls."""
    return "tool_calls" if tool_calls and finish_reason == "stop" else finish_reason
