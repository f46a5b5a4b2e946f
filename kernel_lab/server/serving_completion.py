"""POST /v1/completions: the legacy completions API (prompt: a text, texts, token ids or lists of token ids;
n choices per prompt; echo; logprobs)."""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request

from kernel_lab.engine.outputs import CompletionOutput

from .logprobs import completion_logprobs, prompt_logprobs
from .protocol import CompletionRequest, bad_request
from .serving import Job, OpenAIServing


class CompletionServing(OpenAIServing):
    async def create(self, body: CompletionRequest, raw: Request):
        arrival = time.monotonic()
        self.check_ready()
        lora_request = self.check_model(body.model)
        if body.best_of is not None and body.best_of != body.n:
            raise bad_request("best_of must equal n (this server does not rank candidates)", "best_of")
        scoring = body.echo and body.logprobs is not None   # every prompt token's logprob, then the completion's
        if scoring and body.stream:
            raise bad_request("echo with logprobs is not supported when streaming", "echo")
        if body.max_tokens == 0 and not scoring:
            raise bad_request("max_tokens=0 needs echo with logprobs (scoring the prompt)", "max_tokens")
        prompts = _prompt_list(body.prompt)
        for prompt in prompts:
            if isinstance(prompt, str):
                self.check_prompt_chars(len(prompt), "prompt")
        jobs = await self.prepare(lambda: [self._job(i, prompt) for i, prompt in enumerate(prompts)])
        longest = max(len(job.prompt_ids) for job in jobs)
        explicit = "max_tokens" in body.model_fields_set and body.max_tokens is not None
        max_tokens = 0 if explicit and body.max_tokens == 0 else \
            self.max_tokens(longest, body.max_tokens if explicit else None, body.max_tokens or 16, "max_tokens")
        params = self.sampling_params(body, max_tokens, body.logprobs,
                                      prompt_logprobs=body.logprobs if scoring else None)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        await self.check_grammar(params)
        await self.submit(jobs, request_id, params, arrival, lora_request)
        if body.stream:
            return self.sse(self._stream(body, jobs, request_id), jobs)
        choices = [self._choice(body, job, out) for job, outs in zip(jobs, await self.collect(raw, jobs), strict=True)
                   for out in outs]
        return self.response(request_id, "text_completion", choices, jobs)

    def _job(self, index: int, prompt) -> Job:
        if isinstance(prompt, str):
            ids, text = self.tokenize(prompt, "prompt"), prompt
        else:
            ids, text = list(prompt), None   # their range: the engine's check (see OpenAIServing.submit)
        if not ids:
            raise bad_request("prompt must not be empty", "prompt")
        return Job(index, ids, text)

    def _prompt_text(self, job: Job) -> str:
        if job.prompt_text is None:
            job.prompt_text = self.tokenizer.decode(job.prompt_ids, skip_special_tokens=True)
        return job.prompt_text

    def _choice(self, body: CompletionRequest, job: Job, out: CompletionOutput) -> dict:
        logprobs = None
        if body.logprobs is not None and body.echo:
            logprobs = prompt_logprobs(job.prompt_ids, job.prompt_logprobs, body.logprobs, self.token_text)
            after = completion_logprobs(out, len(self._prompt_text(job)), body.logprobs, self.token_text)
            logprobs = {key: logprobs[key] + after[key] for key in logprobs}
        elif body.logprobs is not None:
            logprobs = completion_logprobs(out, 0, body.logprobs, self.token_text)
        return {"index": job.prompt_index * body.n + out.index,
                "text": self._prompt_text(job) + out.text if body.echo else out.text,
                "logprobs": logprobs, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}

    def _stream(self, body: CompletionRequest, jobs: list[Job], request_id: str):
        echoed = [{"index": job.prompt_index * body.n + i, "text": self._prompt_text(job), "logprobs": None,
                   "finish_reason": None} for job in jobs for i in range(body.n)] if body.echo else []

        def choice(job: Job, out: CompletionOutput, text_offset: int) -> dict:
            logprobs = None
            if body.logprobs is not None and out.token_ids:
                logprobs = completion_logprobs(out, text_offset, body.logprobs, self.token_text)
            return {"index": job.prompt_index * body.n + out.index, "text": out.text, "logprobs": logprobs}

        return self.stream(body, jobs, request_id, "text_completion", echoed, choice)


def _prompt_list(prompt) -> list:
    return [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt


def add_routes(app: FastAPI, serving: CompletionServing) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await serving.create(body, raw)
