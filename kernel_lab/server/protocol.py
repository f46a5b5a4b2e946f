"""What the OpenAI-compatible server accepts and how it refuses: request schemas (pydantic, unknown fields
rejected, explicit nulls meaning "default"), the OpenAI-shaped error type, and the mapping from engine
exceptions and validation failures to status codes and messages.

Every field and its status: projects/09_engine/SERVER.md. Refused with 400: suffix, best_of other than n,
echo with logprobs, and any unknown field (one that would change the output and is not implemented).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kernel_lab.engine.errors import RequestFieldError
from kernel_lab.engine.sampling_params import MAX_LOGPROBS, SAMPLING_BOUNDS

from .async_engine import EngineDead, EngineNotReady, QueueFull, RequestFailed, RequestRejected

log = logging.getLogger("kernel_lab.server")

MAX_N = 128
MAX_TOOLS = 128                # OpenAI's own limit on a request's tools
MAX_TOOLS_CHARS = 262_144      # all tools, serialized: the template renders them into the prompt, and a forced
                               # tool_choice compiles all of their schemas into one grammar
MAX_SPEC_CHARS = 65_536        # one structured-output value (a schema, regex, grammar, choice list) serialized:
                               # it bounds the grammar compile work one request can ask for
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


# ====================================================================== schemas
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        # OpenAI's API treats an explicit null like an absent field.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


StopField = str | list[str] | None  # their count and lengths: SamplingParams checks them, once


class SamplingFields(_Strict):
    model: str | None = None
    temperature: float | None = Field(None, le=2.0, **SAMPLING_BOUNDS["temperature"])  # le: OpenAI's bound
    top_p: float | None = Field(None, **SAMPLING_BOUNDS["top_p"])
    top_k: int | None = Field(None, description="vLLM extension", **SAMPLING_BOUNDS["top_k"])
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: StopField = None
    stop_token_ids: list[int] | None = None  # ranges and count: SamplingParams.verify, in the engine
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # the logits processors (engine/logits_processors.py validates them: SamplingParams reports a bad value)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(None, description="vLLM extension")
    logit_bias: dict[str, float] | None = None
    min_p: float | None = Field(None, description="vLLM extension")
    min_tokens: int | None = Field(None, description="vLLM extension")
    allowed_token_ids: list[int] | None = Field(None, description="vLLM extension")
    bad_words: list[str] | None = Field(None, description="vLLM extension")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured outputs (engine/structured_output.py reads them from the request as it came)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted and ignored: they change nothing in the output here
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    @field_validator("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
    @classmethod
    def _spec_size(cls, value):
        if value is not None and serialized_chars(value) > MAX_SPEC_CHARS:
            raise ValueError(f"at most {MAX_SPEC_CHARS} characters serialized, got {serialized_chars(value)}")
        return value

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: (
        Annotated[str, Field()]
        | Annotated[list[str], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    max_tokens: int | None = Field(16, ge=0, description="0: score the prompt (echo with logprobs)")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix is not supported by this server")
        return value


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI; max_completion_tokens wins")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _tools_are_functions(cls, value):
        check_tools_size(value)
        for tool in value or ():
            if tool.get("type") != "function" or not isinstance(tool.get("function"), dict) \
                    or not isinstance(tool["function"].get("name"), str):
                raise ValueError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
        return value


def serialized_chars(value) -> int:
    """The size of a client's value as the server will use it: a string as is, anything else as JSON."""
    return len(value) if isinstance(value, str) else len(json.dumps(value, ensure_ascii=False))


def check_tools_size(tools) -> None:
    """A `tools` list's count and serialized size (ValueError: pydantic names the field)."""
    if tools is not None and len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools, got {len(tools)}")
    if tools is not None and serialized_chars(tools) > MAX_TOOLS_CHARS:
        raise ValueError(f"at most {MAX_TOOLS_CHARS} characters serialized, got {serialized_chars(tools)}")


# ====================================================================== errors
class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def engine_error(exc: Exception) -> APIError:
    if isinstance(exc, EngineNotReady):
        return APIError(503, str(exc), type="server_error", code="model_loading", headers={"Retry-After": "5"})
    if isinstance(exc, QueueFull):
        return APIError(
            429,
            f"{exc}; retry after {exc.retry_after_s} s",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, (RequestRejected, RequestFieldError)):  # the engine's refusal names the field itself
        return bad_request(str(exc), exc.param)
    if isinstance(exc, EngineDead):
        return APIError(500, str(exc), type="server_error", code="engine_dead")
    if isinstance(exc, RequestFailed):
        return APIError(500, str(exc), type="server_error", code="request_failed")
    log.exception("unexpected error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param
