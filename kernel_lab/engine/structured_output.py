"""What a request asks its output to match: one `StructuredOutputSpec` from the fields clients send.

Accepted, as OpenAI and vLLM accept them:

- OpenAI `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON object),
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}}`;
- vLLM's `structured_outputs` object with exactly one of `json` (a schema, as an object or a JSON string),
  `json_object` (true), `regex`, `choice` (a list of strings), `grammar` (xgrammar's EBNF);
- vLLM's older top-level fields `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

A request may use one of these; more than one (or two members of `structured_outputs`) is a
RequestFieldError (errors.py) naming them. A malformed value (a schema that is not an object, an empty choice
list, a regex that is not a string) is a RequestFieldError whose `param` names the field here; a well-formed
value that the grammar engine rejects (an unsupported schema, a regex or EBNF that does not parse) fails at
compile time (`grammar.py`), with the same parameter name, which `spec.param` carries.

Pure Python and no grammar engine: the server validates requests with it before anything is queued.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import RequestFieldError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One grammar request.

    kind: "json" (value: the JSON schema, canonical JSON text), "json_object" (value ""), "regex" (the
    pattern), "choice" (a JSON list of the strings) or "grammar" (EBNF text). `strict` applies to "json":
    no properties or items beyond the schema's. Strict unless a request says `"strict": false`, for every
    field that takes a schema (vLLM keeps xgrammar's strict default everywhere; a non-strict grammar lets
    the model add keys the schema never declared). `param` is the request field it came from, for errors.
    Two specs with equal `key` compile to the same grammar (the compile cache's key)."""

    kind: str
    value: str
    strict: bool = True
    param: str = "structured_outputs"

    @property
    def key(self) -> tuple[str, str, bool]:
        return (self.kind, self.value, self.strict if self.kind == "json" else True)

    @property
    def choices(self) -> list[str]:
        if self.kind != "choice":
            raise ValueError(f"a {self.kind!r} spec has no choices")
        return json.loads(self.value)


def _schema_text(value, param: str) -> str:
    """A schema (object, bool, or JSON text of one) as compact JSON text, the compile cache's key."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RequestFieldError(param,
                                    f"{param} must be a JSON schema (an object, or JSON text of one): {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise RequestFieldError(param, f"{param} must be a JSON schema object, got {type(value).__name__}")
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)  # key order kept: it orders the output


def _non_empty_string(value, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise RequestFieldError(param, f"{param} must be a non-empty string, got {value!r}")
    return value


def _choice_text(value, param: str) -> str:
    if (not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(c, str) and c for c in value)):
        raise RequestFieldError(param, f"{param} must be a non-empty list of non-empty strings, got {value!r}")
    return json.dumps(list(dict.fromkeys(value)), ensure_ascii=False)  # duplicates dropped, order kept


def make_spec(kind: str, value, param: str, strict: bool | None = None) -> StructuredOutputSpec:
    """A spec of `kind` from a request value, checked for shape; errors name `param`. `strict`: what the
    request said (None: it said nothing, which is strict)."""
    if kind == "json":
        return StructuredOutputSpec("json", _schema_text(value, param), strict is not False, param)
    if kind == "json_object":
        if value is not True:
            raise RequestFieldError(param, f"{param} must be true, got {value!r}")
        return StructuredOutputSpec("json_object", "", True, param)
    if kind in ("regex", "grammar"):
        return StructuredOutputSpec(kind, _non_empty_string(value, param), True, param)
    if kind == "choice":
        return StructuredOutputSpec("choice", _choice_text(value, param), True, param)
    raise RequestFieldError(param, f"unknown structured output kind {kind!r}; expected one of {KINDS}")


def _from_response_format(fmt) -> StructuredOutputSpec | None:
    if not isinstance(fmt, Mapping):
        raise RequestFieldError("response_format", f"response_format must be an object with a 'type', got {fmt!r}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec("json_object", "", True, "response_format")
    if kind == "json_schema":
        body = fmt.get("json_schema")
        if not isinstance(body, Mapping):
            raise RequestFieldError("response_format.json_schema",
                                    "response_format.json_schema must be an object with 'name' and 'schema'")
        if "schema" not in body:
            raise RequestFieldError("response_format.json_schema.schema",
                                    "response_format.json_schema.schema is required")
        strict = body.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise RequestFieldError("response_format.json_schema.strict",
                                    f"response_format.json_schema.strict must be a boolean, got {strict!r}")
        return make_spec("json", body["schema"], "response_format.json_schema.schema", strict)
    raise RequestFieldError("response_format.type",
                            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _from_structured_outputs(obj) -> StructuredOutputSpec | None:
    if not isinstance(obj, Mapping):
        raise RequestFieldError("structured_outputs", f"structured_outputs must be an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(KINDS))  # e.g. whitespace_pattern: it changes the output, not implemented
    if unknown:
        raise RequestFieldError("structured_outputs",
                                f"structured_outputs has unknown field(s) {unknown}; expected one of {list(KINDS)}")
    present = [k for k in KINDS if obj.get(k) is not None and obj.get(k) is not False]
    if len(present) > 1:
        raise RequestFieldError("structured_outputs",
                                f"structured_outputs sets {', '.join(present)}: give only one of them")
    if not present:
        return None
    kind = present[0]
    return make_spec(kind, obj[kind], f"structured_outputs.{kind}")


def parse_structured_output(request: Mapping) -> StructuredOutputSpec | None:
    """The one structured-output spec of a request body (chat or completions), or None for free text.

    Raises ValueError naming the fields when several sources are set, or naming the malformed field."""
    sources = {}
    if request.get("response_format") is not None:
        spec = _from_response_format(request["response_format"])
        if spec is not None:
            sources["response_format"] = spec
    if request.get("structured_outputs") is not None:
        spec = _from_structured_outputs(request["structured_outputs"])
        if spec is not None:
            sources["structured_outputs"] = spec
    for name, kind in GUIDED_FIELDS.items():
        if request.get(name) is not None:
            sources[name] = make_spec(kind, request[name], name)
    if len(sources) > 1:
        raise RequestFieldError(next(iter(sources)),
                                f"conflicting structured-output fields {', '.join(sources)}: give only one of them")
    return next(iter(sources.values()), None)


def ebnf_string_literal(text: str) -> str:
    """`text` as a double-quoted EBNF literal: JSON's escapes (quotes, backslashes, control characters),
    which xgrammar's EBNF accepts."""
    return json.dumps(text, ensure_ascii=False)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the given strings."""
    return "root ::= " + " | ".join(ebnf_string_literal(c) for c in choices)
