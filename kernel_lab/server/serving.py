"""What every OpenAI endpoint shares: the served model's facts, prompt and parameter checks, submission to
the AsyncEngine, collecting a whole answer, and the SSE loop. One module per endpoint
(serving_completion.py, serving_chat.py) subclasses OpenAIServing and adds its routes; app.py assembles them.

Handlers never touch the engine: they tokenize, validate, submit and read the engine's output deltas
(RequestOutputKind.DELTA) from the request's stream. The engine's output processor already held back text
that could still become a stop string and unfinished UTF-8 characters, so a delta goes to the client as it
is and the concatenated stream always equals the non-streamed text.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kernel_lab.engine.errors import RequestFieldError, error_param
from kernel_lab.engine.grammar import GrammarCompileError
from kernel_lab.engine.interface import Engine
from kernel_lab.engine.logits_processors import check_token_ids
from kernel_lab.engine.outputs import CompletionOutput, RequestOutput, merge_deltas
from kernel_lab.engine.sampling_params import RequestOutputKind, SamplingParams
from kernel_lab.engine.structured_output import StructuredOutputSpec, parse_structured_output

from .async_engine import (
    AsyncEngine,
    EngineDead,
    EngineNotReady,
    QueueFull,
    RequestFailed,
    RequestRejected,
    RequestStream,
)
from .preparation import PreparationPool
from .protocol import APIError, SamplingFields, StreamOptions, bad_request, engine_error

log = logging.getLogger("kernel_lab.server")


class Job:
    """One engine request inside an API request (one prompt, n choices)."""

    def __init__(self, prompt_index: int, prompt_ids: list[int], prompt_text: str | None):
        self.prompt_index = prompt_index
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        self.stream: RequestStream | None = None
        self.completion_tokens = 0
        self.finished = False
        self.prompt_logprobs: list | None = None

    def count(self, delta: RequestOutput) -> None:
        self.completion_tokens += sum(len(c.token_ids) for c in delta.outputs)
        self.finished = delta.finished
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


def lora_requests(lora_modules: dict[str, str] | None) -> dict:
    """--lora-modules {name: path} as LoRARequests (ids in flag order, from 1): a request's `model` field
    selects one by name."""
    from kernel_lab.engine.lora import LoRARequest

    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate((lora_modules or {}).items())}


class OpenAIServing:
    def __init__(self, async_engine: AsyncEngine, *, served_model_name: str | None = None,
                 model_path: str | None = None, preparation: PreparationPool | None = None,
                 lora_modules: dict[str, str] | None = None, lora_requests_by_name: dict | None = None):
        self.async_engine = async_engine
        # {name: LoRARequest}: the app passes one dict to every endpoint, which the runtime load/unload
        # routes change in place; lora_modules builds a private one
        self.lora_requests = lora_requests(lora_modules) if lora_requests_by_name is None else lora_requests_by_name
        self.preparation = preparation or PreparationPool()  # the app shares one between its endpoints
        self._served_name = served_model_name
        self.model_path = model_path
        self.created = int(time.time())

    # ---------------------------------------------------------------- the served model
    @property
    def engine(self) -> Engine:
        return self.async_engine.engine

    @property
    def model_name(self) -> str:
        return self._served_name or self.engine.config.model_name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one server per process, the cache is its lifetime
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_ready(self) -> None:
        try:
            self.async_engine.check_ready()
        except (EngineNotReady, EngineDead) as exc:
            raise engine_error(exc) from exc

    def check_model(self, requested: str | None):
        """The LoRARequest of the adapter `requested` names, None for the base model; 404 for anything else."""
        if requested in self.lora_requests:
            return self.lora_requests[requested]
        if requested is not None and requested != self.model_name:
            served = ", ".join(f"`{n}`" for n in (self.model_name, *self.lora_requests))
            raise APIError(404, f"The model `{requested}` does not exist. This server serves {served}.",
                           param="model", code="model_not_found")
        return None

    # ---------------------------------------------------------------- request building
    @property
    def prompt_char_limit(self) -> int:
        """The most characters a prompt can have and still fit max_model_len tokens (see
        Tokenizer.max_token_chars: a text of C characters has at least C / max_token_chars tokens)."""
        return self.max_model_len * self.tokenizer.max_token_chars

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """Before tokenizing (on the loop, it costs nothing): a text that cannot fit is refused without
        paying for its tokenization, which grows with the text."""
        if chars > self.prompt_char_limit:
            raise bad_request(f"{param} has {chars} characters; at most {self.prompt_char_limit} can fit this "
                              f"model's maximum context length of {self.max_model_len} tokens (a token stands "
                              f"for at most {self.tokenizer.max_token_chars} characters)", param)

    async def prepare(self, fn, *args):
        """fn(*args) (tokenizing, rendering a template) on the preparation pool, off the event loop."""
        return await self.preparation.run(fn, *args)

    def tokenize(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """On the preparation pool (see prepare); check_prompt_chars first."""
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as exc:  # noqa: BLE001 - a prompt the tokenizer rejects is the client's error
            raise bad_request(f"{param} could not be tokenized: {exc}", param) from exc

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """For /detokenize, which reaches the tokenizer and not the engine (a request's ids: add_request)."""
        try:
            check_token_ids(param, ids, self.engine.config.vocab_size)
        except RequestFieldError as exc:
            raise bad_request(str(exc), exc.param) from exc

    @property
    def sampling_defaults(self) -> dict:
        """The model's generation_config.json values (--generation-config auto), for fields a request omits."""
        return self.engine.config.sampling_defaults

    def max_tokens(self, prompt_len: int, requested: int | None, default: int | None, param: str,
                   prompt_param: str = "prompt") -> int:
        """The completion's length: the request's, else `default`, else the room left; never past the
        model's max_new_tokens (vLLM caps even a request's own max_tokens with it)."""
        chosen = self._max_tokens(prompt_len, requested, default, param, prompt_param)
        cap = self.sampling_defaults.get("max_tokens")
        return chosen if cap is None else min(chosen, cap)

    def _max_tokens(self, prompt_len: int, requested: int | None, default: int | None, param: str,
                    prompt_param: str) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens, and the "
                              f"prompt has {prompt_len} tokens, leaving no room for a completion.", prompt_param)
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                              f"{requested} for the completion).", param)
        return requested

    def sampling_params(self, body: SamplingFields, max_tokens: int, logprobs: int | None,
                        structured: StructuredOutputSpec | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's SamplingParams; a value it refuses is a 400 naming the parameter. `structured`: a
        spec the endpoint made itself (a forced tool call); else the request's structured-output fields. The
        checks against the model are the engine's (SamplingParams.verify in add_request; see `submit`)."""
        try:
            if structured is None:
                structured = parse_structured_output(body.model_dump(exclude_none=True))
            defaults = self.sampling_defaults
            controls = {name: getattr(body, name) for name in _CONTROLS if getattr(body, name) is not None}
            for name in ("repetition_penalty", "min_p"):
                if name not in controls and name in defaults:
                    controls[name] = defaults[name]

            def chosen(name: str, neutral):
                value = getattr(body, name)
                return value if value is not None else defaults.get(name, neutral)

            params = SamplingParams(
                n=body.n, temperature=chosen("temperature", 1.0), top_p=chosen("top_p", 1.0),
                top_k=chosen("top_k", 0), seed=body.seed, max_tokens=max_tokens, stop=body.stop,
                stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos, logprobs=logprobs, output_kind=RequestOutputKind.DELTA,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens, structured_outputs=structured,
                prompt_logprobs=prompt_logprobs, **controls)
        except (ValueError, TypeError) as exc:
            raise bad_request(f"invalid sampling parameters: {exc}", error_param(exc)) from exc
        return params

    async def check_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar before it is queued (off the event loop and the engine thread, in
        the engine's compile service, whose cache the engine then hits): a grammar that fails is a 400 and
        the engine never sees the request. An engine without a compile service refuses structured outputs."""
        spec = params.structured_outputs
        if spec is None:
            return
        loop = asyncio.get_running_loop()
        service = await loop.run_in_executor(None, lambda: self.engine.grammar_service)  # built on first use
        if service is None:
            raise bad_request("this engine has no grammar engine for structured outputs", spec.param)
        try:
            await self.preparation.wait(service.submit(spec))
        except GrammarCompileError as exc:
            raise bad_request(str(exc), spec.param) from exc

    async def submit(self, jobs: list[Job], request_id: str, params: SamplingParams, arrival: float,
                     lora_request=None) -> None:
        """Queue the jobs and wait until the engine took them: the engine's add_request is where a request
        is checked against the model, once, so its refusal is a 400 before any response (or stream) began."""
        try:
            for job in jobs:
                job.stream = self.async_engine.submit(f"{request_id}-{job.prompt_index}", job.prompt_ids, params,
                                                      arrival, lora_request)
            for job in jobs:
                await job.stream.admitted()
        except BaseException as exc:  # cancelled too (the client left): nothing of the request stays queued
            for job in jobs:
                if job.stream is not None:
                    job.stream.close()
            if isinstance(exc, QueueFull):
                self.async_engine.metrics.on_rejected("queue_full")
            if not isinstance(exc, Exception):
                raise
            raise engine_error(exc) from exc

    # ---------------------------------------------------------------- whole answers
    @staticmethod
    async def _watch_disconnect(raw: Request, jobs: list[Job]) -> bool:
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                for job in jobs:
                    job.stream.close()
                return True

    async def collect(self, raw: Request, jobs: list[Job]) -> list[list[CompletionOutput]]:
        """Each job's completions, whole (its deltas merged once, at the end)."""
        deltas: list[list[RequestOutput]] = [[] for _ in jobs]

        async def drain(job: Job, into: list) -> None:
            async for delta in job.stream:
                job.count(delta)
                into.append(delta)

        watcher = asyncio.ensure_future(self._watch_disconnect(raw, jobs))
        try:
            await asyncio.gather(*(drain(job, into) for job, into in zip(jobs, deltas, strict=True)))
        except Exception as exc:
            raise engine_error(exc) from exc
        finally:
            gone = watcher.done() and not watcher.cancelled() and watcher.exception() is None and watcher.result()
            watcher.cancel()
            for job in jobs:
                job.stream.close()
        if gone or not all(job.finished for job in jobs):
            # nginx's "client closed request": nobody reads it, but the handler ends now
            raise APIError(499, "the client disconnected before the completion finished", code="client_closed")
        return [merge_deltas(d).outputs for d in deltas]

    def response(self, request_id: str, obj: str, choices: list[dict], jobs: list[Job]) -> JSONResponse:
        return JSONResponse({"id": request_id, "object": obj, "created": int(time.time()),
                             "model": self.model_name, "choices": choices, "usage": usage(jobs)})

    # ---------------------------------------------------------------- streams
    async def stream(self, body, jobs: list[Job], request_id: str, obj: str, first_choices: list[dict],
                     make_choice):
        """The SSE stream every generating route shares: `make_choice(job, delta, text_offset)` shapes a
        choice from one completion's delta (text_offset: how much of the choice's text was sent before it)
        and the loop adds the finish fields."""
        created = int(time.time())
        options = body.stream_options or StreamOptions()
        sent_chars: dict[tuple[int, int], int] = {}
        done: set[tuple[int, int]] = set()

        def chunk(choices: list[dict], usage_: dict | None = None) -> str:
            payload = {"id": request_id, "object": obj, "created": created, "model": self.model_name,
                       "choices": choices}
            if options.include_usage:
                payload["usage"] = usage_
            return sse_event(payload)

        if first_choices:
            yield chunk(first_choices)
        async for job, delta in _merged(jobs):
            job.count(delta)
            choices = []
            for out in delta.outputs:
                key = (job.prompt_index, out.index)
                final = out.finish_reason is not None
                if key in done or not (out.text or out.token_ids or final):
                    continue
                offset = sent_chars.get(key, 0)
                choice = make_choice(job, out, offset)
                # a choice may restate its finish reason (a chat that made tool calls says "tool_calls")
                choice.update(finish_reason=choice.get("finish_reason", out.finish_reason),
                              stop_reason=out.stop_reason if final else None)
                choices.append(choice)
                sent_chars[key] = offset + len(out.text)
                if final:
                    done.add(key)
            if choices:
                yield chunk(choices, usage(jobs) if options.continuous_usage_stats else None)
        if options.include_usage:
            yield chunk([], usage(jobs))

    def sse(self, events, jobs: list[Job]) -> StreamingResponse:
        async def guarded():
            try:
                async for event in events:
                    yield event
            except APIError as exc:
                yield sse_event(exc.body())
            except (EngineDead, RequestRejected, RequestFailed, QueueFull, EngineNotReady) as exc:
                yield sse_event(engine_error(exc).body())
            except Exception as exc:  # noqa: BLE001 - headers are gone; report in-band
                log.exception("error while streaming")
                yield sse_event(engine_error(exc).body())
            finally:
                # also reached when the client disconnects (the task is cancelled): abort what still runs
                for job in jobs:
                    job.stream.close()
            yield "data: [DONE]\n\n"

        return StreamingResponse(guarded(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


_CONTROLS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens",
             "allowed_token_ids", "bad_words")


def usage(jobs: list[Job]) -> dict:
    prompt = sum(len(job.prompt_ids) for job in jobs)
    completion = sum(job.completion_tokens for job in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


async def _merged(jobs: list[Job]):
    """Yield (job, delta) from several streams as they arrive; one stream needs no tasks."""
    if len(jobs) == 1:
        async for delta in jobs[0].stream:
            yield jobs[0], delta
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async for delta in job.stream:
                merged.put_nowait((job, delta))
        except Exception as exc:  # noqa: BLE001 - forwarded to the consumer
            merged.put_nowait((job, exc))
        merged.put_nowait((job, None))

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    try:
        remaining = len(jobs)
        while remaining:
            job, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield job, item
    finally:
        for task in tasks:
            task.cancel()
