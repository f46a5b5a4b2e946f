"""POST /v1/chat/completions: chat through the model's chat template (n choices, logprobs)."""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request

from kernel_lab.engine.outputs import CompletionOutput

from .logprobs import chat_logprobs
from .protocol import ChatCompletionRequest, bad_request
from .serving import Job, OpenAIServing


class ChatServing(OpenAIServing):
    async def create(self, body: ChatCompletionRequest, raw: Request):
        arrival = time.monotonic()
        self.check_ready()
        self.check_model(body.model)
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        ids = self._render(body)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens(len(ids), requested, None, param, prompt_param="messages")
        top = body.top_logprobs or 0
        params = self.sampling_params(body, max_tokens, top if body.logprobs else None)
        jobs = [Job(0, ids, None)]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        await self.check_grammar(params)
        self.submit(jobs, request_id, params, arrival)
        if body.stream:
            return self.sse(self._stream(body, jobs, request_id), jobs)
        (outs,) = await self.collect(raw, jobs)
        choices = [{"index": out.index, "message": {"role": "assistant", "content": out.text},
                    "logprobs": {"content": chat_logprobs(out, top, self.token_text)} if body.logprobs else None,
                    "finish_reason": out.finish_reason, "stop_reason": out.stop_reason} for out in outs]
        return self.response(request_id, "chat.completion", choices, jobs)

    def _render(self, body: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        except Exception as exc:  # noqa: BLE001 - a template refusal is the client's error
            raise bad_request(f"messages could not be rendered by the chat template: {exc}", "messages") from exc
        if not ids:
            raise bad_request("messages render to an empty prompt", "messages")
        return ids

    def _stream(self, body: ChatCompletionRequest, jobs: list[Job], request_id: str):
        top = body.top_logprobs or 0
        roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(body.n)]

        def choice(job: Job, out: CompletionOutput, text_offset: int) -> dict:
            logprobs = None
            if body.logprobs and out.token_ids:
                logprobs = {"content": chat_logprobs(out, top, self.token_text)}
            return {"index": out.index, "delta": {"content": out.text} if out.text else {}, "logprobs": logprobs}

        return self.stream(body, jobs, request_id, "chat.completion.chunk", roles, choice)


def add_routes(app: FastAPI, serving: ChatServing) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await serving.create(body, raw)
