"""POST /tokenize and /detokenize, in vLLM's shapes: a prompt (or chat messages, through the chat template)
to token ids with the count and max_model_len; token ids back to text."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI
from pydantic import Field, field_validator

from .protocol import ChatMessage, _Strict, bad_request, check_tools_size
from .serving import OpenAIServing
from .serving_chat import message_chars, render_messages


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None     # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @field_validator("tools")
    @classmethod
    def _tools_size(cls, value):
        check_tools_size(value)
        return value


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class TokenizationServing(OpenAIServing):
    async def tokenize_request(self, body: TokenizeRequest) -> dict:
        self.check_ready()
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if body.prompt is not None:
            self.check_prompt_chars(len(body.prompt), "prompt")
            ids = await self.prepare(self.tokenize, body.prompt, "prompt", body.add_special_tokens is not False)
        else:
            self.check_prompt_chars(message_chars(body.messages), "messages")
            ids = await self.prepare(render_messages, self.tokenizer, body.messages, body.tools,
                                     body.chat_template_kwargs, body.add_generation_prompt)
            if body.add_special_tokens:
                ids = list(self.tokenizer.encode("", add_special_tokens=True)) + ids
        strs = [self.token_text(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize_request(self, body: DetokenizeRequest) -> dict:
        self.check_ready()
        self.check_model(body.model)
        self.check_token_ids(body.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens, skip_special_tokens=False)}


def add_routes(app: FastAPI, serving: TokenizationServing) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await serving.tokenize_request(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return serving.detokenize_request(body)
