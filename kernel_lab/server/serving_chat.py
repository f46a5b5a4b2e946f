"""POST /v1/chat/completions: chat through the model's chat template (n choices, logprobs, tools).

Tools: `tools` reach the chat template (with `chat_template_kwargs`); `tool_choice` "auto" (the default
with tools) parses Hermes `<tool_call>` blocks from free text; "required" or a named function constrains
the output by the tools' schemas (engine/tool_calls.py: tool_choice_spec) so the calls always parse; "none"
leaves the text alone. A choice that made calls ends with finish_reason "tool_calls"."""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request

from kernel_lab.engine.outputs import CompletionOutput
from kernel_lab.engine.tool_calls import ForcedToolParser, HermesToolParser, tool_calls_finish_reason, tool_choice_spec

from .logprobs import chat_logprobs
from .protocol import ChatCompletionRequest, bad_request
from .serving import Job, OpenAIServing


class ChatServing(OpenAIServing):
    async def create(self, body: ChatCompletionRequest, raw: Request):
        arrival = time.monotonic()
        self.check_ready()
        lora_request = self.check_model(body.model)
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        self.check_prompt_chars(message_chars(body.messages), "messages")
        ids = await self.prepare(self._render, body)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens(len(ids), requested, None, param, prompt_param="messages")
        top = body.top_logprobs or 0
        forced = self._tool_spec(body)
        params = self.sampling_params(body, max_tokens, top if body.logprobs else None, forced)
        jobs = [Job(0, ids, None)]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        await self.check_grammar(params)
        await self.submit(jobs, request_id, params, arrival, lora_request)
        if body.stream:
            return self.sse(self._stream(body, jobs, request_id, forced is not None), jobs)
        (outs,) = await self.collect(raw, jobs)
        choices = []
        for out in outs:
            message, reason = self._message(body, forced is not None, out)
            logprobs = {"content": chat_logprobs(out, top, self.token_text)} if body.logprobs else None
            choices.append({"index": out.index, "message": message, "logprobs": logprobs,
                            "finish_reason": reason, "stop_reason": out.stop_reason})
        return self.response(request_id, "chat.completion", choices, jobs)

    @staticmethod
    def _parses_tools(body: ChatCompletionRequest) -> bool:
        return bool(body.tools) and body.tool_choice != "none"

    def _tool_spec(self, body: ChatCompletionRequest):
        """The structured-output spec that forces tool_choice (required / named), or None."""
        if body.tool_choice not in (None, "none", "auto") and not body.tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        if not body.tools:
            return None
        try:
            spec = tool_choice_spec(body.tools, body.tool_choice, body.parallel_tool_calls is not False)
        except ValueError as exc:
            raise bad_request(str(exc), "tool_choice") from exc
        if spec is not None and any(getattr(body, f) is not None for f in
                                    ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                     "guided_choice", "guided_grammar")):
            raise bad_request("a forced tool_choice cannot be combined with a structured-output field", "tool_choice")
        return spec

    def _tool_parser(self, body: ChatCompletionRequest, forced: bool) -> ForcedToolParser | HermesToolParser | None:
        """One parser per choice, for the streamed and the whole answer alike."""
        if forced:
            return ForcedToolParser(body.tool_choice)
        return HermesToolParser() if self._parses_tools(body) else None

    def _message(self, body: ChatCompletionRequest, forced: bool, out: CompletionOutput) -> tuple[dict, str | None]:
        parser = self._tool_parser(body, forced)
        if parser is not None:
            content, calls = parser.parse(out.text)
            if calls:
                return ({"role": "assistant", "content": content, "tool_calls": calls},
                        tool_calls_finish_reason(calls, out.finish_reason))
        # no call: a forced call cut before its JSON was complete (a stop string, a length cut) is content too
        return {"role": "assistant", "content": out.text}, out.finish_reason

    def _render(self, body: ChatCompletionRequest) -> list[int]:
        return render_messages(self.tokenizer, body.messages, _rendered_tools(body), body.chat_template_kwargs)

    def _stream(self, body: ChatCompletionRequest, jobs: list[Job], request_id: str, forced: bool = False):
        top = body.top_logprobs or 0
        roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(body.n)]
        parsers = {i: self._tool_parser(body, forced) for i in range(body.n)}

        def choice(job: Job, out: CompletionOutput, text_offset: int) -> dict:
            logprobs = None
            if body.logprobs and out.token_ids:
                logprobs = {"content": chat_logprobs(out, top, self.token_text)}
            parser = parsers.get(out.index)
            if parser is None:
                return {"index": out.index, "delta": {"content": out.text} if out.text else {}, "logprobs": logprobs}
            deltas = parser.feed(out.text) + (parser.finish() if out.finish_reason is not None else [])
            result = {"index": out.index, "delta": _merge_deltas(deltas), "logprobs": logprobs}
            if out.finish_reason is not None:
                result["finish_reason"] = tool_calls_finish_reason(parser.tool_calls, out.finish_reason)
            return result

        return self.stream(body, jobs, request_id, "chat.completion.chunk", roles, choice)


def _rendered_tools(body: ChatCompletionRequest) -> list | None:
    """The tools the template sees: none with tool_choice "none"."""
    return body.tools if body.tool_choice != "none" else None


def message_chars(messages) -> int:
    """The characters of the messages' contents: every template renders them (their tokens are at least
    these characters over Tokenizer.max_token_chars). Tools and tool calls are not counted: a template
    may leave them out, and protocol.py bounds their size."""
    return sum(len(m.text()) for m in messages)


def render_messages(tokenizer, messages, tools=None, template_kwargs=None, add_generation_prompt=True) -> list[int]:
    """Token ids of a conversation through the chat template (tools and template kwargs passed to it); a
    template refusal or an empty rendering is a 400 naming `messages`."""
    rendered = []
    for m in messages:
        message = {"role": m.role, "content": m.text()}
        for name in ("tool_calls", "tool_call_id", "name"):
            if getattr(m, name) is not None:
                message[name] = getattr(m, name)
        rendered.append(message)
    kwargs = dict(template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    try:
        ids = list(tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, **kwargs))
    except Exception as exc:  # noqa: BLE001 - a template refusal is the client's error
        raise bad_request(f"messages could not be rendered by the chat template: {exc}", "messages") from exc
    if not ids:
        raise bad_request("messages render to an empty prompt", "messages")
    return ids


def _merge_deltas(deltas: list[dict]) -> dict:
    """A tool parser's deltas of one step as one chunk's delta: the content joined, the call pieces listed."""
    merged: dict = {}
    for delta in deltas:
        if "content" in delta:
            merged["content"] = merged.get("content", "") + delta["content"]
        if "tool_calls" in delta:
            merged.setdefault("tool_calls", []).extend(delta["tool_calls"])
    return merged


def add_routes(app: FastAPI, serving: ChatServing) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await serving.create(body, raw)
