"""OpenAI-compatible HTTP API: the routes and their streaming (schemas and errors: protocol.py).

    POST /v1/completions        legacy completions (prompt: text, texts, token ids, or lists of token ids)
    POST /v1/chat/completions   chat, through the model's chat template
    GET  /v1/models             the one served model
    GET  /health                200 ready, 503 still loading, 500 engine dead
    GET  /metrics               Prometheus text format (see metrics.py)

Both generation routes stream (Server-Sent Events ending in `data: [DONE]`, with
`stream_options.include_usage`) or answer in one JSON body. Handlers never touch the engine: they tokenize,
validate, submit to the AsyncEngine and read snapshots from its stream. Text deltas are computed here
from the engine's cumulative text, holding back a tail that could still become a stop string (by the
engine's own rule, `engine.output_processor.stop_holdback`, which also covers engines that do not hold
back themselves) or that ends in an unfinished UTF-8 character, so the concatenated stream always equals
the non-streamed text.

Error statuses: 400 malformed JSON / bad parameter / prompt too long, 401 bad key, 404 unknown model or
route, 429 (with Retry-After) waiting queue full, 500 engine failure, 503 model still loading.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import math
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kernel_lab.engine.output_processor import stop_holdback

from .async_engine import AsyncEngine, EngineDead, EngineNotReady, QueueFull, RequestRejected, RequestSnapshot
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    StreamOptions,
    bad_request,
    engine_error,
    validation_message,
)

log = logging.getLogger("kernel_lab.server")

# JSON has no infinities; OpenAI reports a logprob too small to represent as this value.
LOGPROB_FLOOR = -9999.0


class BearerAuth:
    """Pure ASGI middleware (so streaming and disconnect detection stay untouched): every /v1 route needs
    `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(
                    401,
                    "invalid or missing API key (send 'Authorization: Bearer <key>')",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ====================================================================== helpers
def _finite(value: float | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    if math.isnan(value) or value < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return min(value, 0.0)


def _logprob_items(entry) -> list[tuple[int, float]]:
    """One position's logprobs from the engine ({token_id: float or object with .logprob}), best first."""
    items = [(int(tok), float(getattr(v, "logprob", v))) for tok, v in dict(entry).items()]
    items.sort(key=lambda kv: -kv[1])
    return items


class _ChoiceCursor:
    """What has been sent of one choice: characters and tokens, for delta computation."""

    __slots__ = ("sent_chars", "sent_tokens", "finished", "started")

    def __init__(self):
        self.sent_chars = 0
        self.sent_tokens = 0
        self.finished = False
        self.started = False

    def advance(self, text: str, final: bool, stops: list[str]) -> str:
        limit = len(text)
        if not final:
            limit -= stop_holdback(text, stops)
            while limit > self.sent_chars and text[limit - 1] == "\ufffd":
                limit -= 1  # an unfinished multi-byte character: wait for the rest
        if limit <= self.sent_chars:
            return ""
        delta = text[self.sent_chars : limit]
        self.sent_chars = limit
        return delta


class _Job:
    """One engine request inside an API request (one prompt, n choices)."""

    def __init__(self, prompt_index: int, prompt_ids: list[int], prompt_text: str | None):
        self.prompt_index = prompt_index
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        self.stream = None
        self.last: RequestSnapshot | None = None


# ====================================================================== the server
class OpenAIServer:
    def __init__(
        self,
        async_engine: AsyncEngine,
        *,
        served_model_name: str | None = None,
        api_key: str | None = None,
        model_path: str | None = None,
    ):
        self.engine = async_engine
        self._served_name = served_model_name
        self.api_key = api_key
        self.model_path = model_path
        self.created = int(time.time())

    # ---------------------------------------------------------------- engine facts
    @property
    def model_name(self) -> str:
        if self._served_name:
            return self._served_name
        engine = self.engine.engine
        return getattr(engine, "model_name", None) or "default"

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.engine.max_model_len)

    @functools.cached_property
    def vocab_size(self) -> int | None:
        engine = self.engine.engine
        for owner in (engine, getattr(engine, "tokenizer", None)):
            size = getattr(owner, "vocab_size", None)
            if isinstance(size, int) and size > 0:
                return size
        return None

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one server per process, the cache is its lifetime
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise APIError(
                404,
                f"The model `{requested}` does not exist. This server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def make_params(self, **kwargs):
        factory = getattr(self.engine, "params_factory", None)
        if factory is None:
            from kernel_lab.engine import SamplingParams as factory
        try:
            return factory(**kwargs)
        except (ValueError, TypeError) as exc:
            raise bad_request(f"invalid sampling parameters: {exc}") from exc

    # ---------------------------------------------------------------- request building
    def _tokenize_text(self, text: str, param: str) -> list[int]:
        try:
            return list(self.tokenizer.encode(text))
        except Exception as exc:  # noqa: BLE001 - a prompt the tokenizer rejects is the client's error
            raise bad_request(f"{param} could not be tokenized: {exc}", param) from exc

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.vocab_size
        if vocab is not None and any(t >= vocab for t in ids):
            raise bad_request(f"{param} holds a token id outside the vocabulary (size {vocab})", param)

    def _max_tokens(
        self, prompt_len: int, requested: int | None, default: int | None, param: str, prompt_param: str = "prompt"
    ) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens, and the "
                f"prompt has {prompt_len} tokens, leaving no room for a completion.",
                prompt_param,
            )
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                f"{requested} for the completion).",
                param,
            )
        return requested

    def _sampling_kwargs(self, body: SamplingFields, max_tokens: int, logprobs: int | None) -> dict:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return dict(
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            seed=body.seed,
            max_tokens=max_tokens,
            stop=stop or None,
            stop_token_ids=list(body.stop_token_ids) if body.stop_token_ids else None,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
        )

    def _submit(self, jobs: list[_Job], request_id: str, params, arrival: float) -> None:
        try:
            for job in jobs:
                job.stream = self.engine.submit(f"{request_id}-{job.prompt_index}", job.prompt_ids, params, arrival)
        except Exception as exc:
            for job in jobs:
                if job.stream is not None:
                    job.stream.close()
            if isinstance(exc, QueueFull):
                self.engine.metrics.on_rejected("queue_full")
            raise engine_error(exc) from exc

    # ---------------------------------------------------------------- collection
    @staticmethod
    async def _watch_disconnect(raw: Request, jobs: list[_Job]) -> bool:
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                for job in jobs:
                    job.stream.close()
                return True

    async def _collect(self, raw: Request, jobs: list[_Job]) -> None:
        async def drain(job: _Job) -> None:
            async for snap in job.stream:
                job.last = snap

        watcher = asyncio.ensure_future(self._watch_disconnect(raw, jobs))
        try:
            await asyncio.gather(*(drain(job) for job in jobs))
        except Exception as exc:
            raise engine_error(exc) from exc
        finally:
            gone = watcher.done() and not watcher.cancelled() and watcher.exception() is None and watcher.result()
            watcher.cancel()
            for job in jobs:
                job.stream.close()
        if gone or any(job.last is None or not job.last.finished for job in jobs):
            # nginx's "client closed request": nobody reads it, but the handler ends now
            raise APIError(499, "the client disconnected before the completion finished", code="client_closed")

    @staticmethod
    async def _merged(jobs: list[_Job]):
        """Yield (job, snapshot) from several streams as they arrive; one stream needs no tasks."""
        if len(jobs) == 1:
            async for snap in jobs[0].stream:
                yield jobs[0], snap
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(job: _Job) -> None:
            try:
                async for snap in job.stream:
                    merged.put_nowait((job, snap))
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

    @staticmethod
    def _usage(jobs: list[_Job]) -> dict:
        prompt = sum(len(job.prompt_ids) for job in jobs)
        completion = sum(len(s.token_ids) for job in jobs if job.last for s in job.last.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ---------------------------------------------------------------- logprobs formatting
    def _completion_logprobs(self, seq, start: int, end: int, offset: int, k: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for pos in range(start, end):
            token = seq.token_ids[pos]
            items = _logprob_items(seq.logprobs[pos]) if seq.logprobs and pos < len(seq.logprobs) else []
            text = self.token_text(token)
            tokens.append(text)
            lookup = dict(items)
            token_lps.append(_finite(lookup.get(token)))
            tops.append({self.token_text(t): _finite(lp) for t, lp in items[:k]} if k else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, seq, start: int, end: int, k: int) -> list[dict]:
        content = []
        for pos in range(start, end):
            token = seq.token_ids[pos]
            items = _logprob_items(seq.logprobs[pos]) if seq.logprobs and pos < len(seq.logprobs) else []
            text = self.token_text(token)
            content.append(
                {
                    "token": text,
                    "logprob": _finite(dict(items).get(token)),
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": self.token_text(t),
                            "logprob": _finite(lp),
                            "bytes": list(self.token_text(t).encode()),
                        }
                        for t, lp in items[:k]
                    ],
                }
            )
        return content

    # ---------------------------------------------------------------- routes: completions
    async def completions(self, body: CompletionRequest, raw: Request):
        arrival = time.monotonic()
        self._check_ready()
        self.check_model(body.model)
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if body.best_of is not None and body.best_of != body.n:
            raise bad_request("best_of must equal n (this server does not rank candidates)", "best_of")
        if body.echo and body.logprobs is not None:
            raise bad_request("echo with logprobs needs prompt logprobs, which this server does not compute", "echo")
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        jobs = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                ids = self._tokenize_text(prompt, "prompt")
                text = prompt
            else:
                ids = list(prompt)
                self._check_token_ids(ids, "prompt")
                text = None
            if not ids:
                raise bad_request("prompt must not be empty", "prompt")
            jobs.append(_Job(i, ids, text))
        longest = max(len(job.prompt_ids) for job in jobs)
        explicit = "max_tokens" in body.model_fields_set and body.max_tokens is not None
        max_tokens = self._max_tokens(
            longest, body.max_tokens if explicit else None, body.max_tokens or 16, "max_tokens"
        )
        params = self.make_params(**self._sampling_kwargs(body, max_tokens, body.logprobs))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        self._submit(jobs, request_id, params, arrival)
        if body.stream:
            return self._sse(self._stream_completion(body, jobs, request_id), jobs)
        await self._collect(raw, jobs)
        choices = []
        for job in jobs:
            for seq in job.last.outputs:
                text = seq.text
                if body.echo:
                    text = self._prompt_text(job) + text
                choices.append(
                    {
                        "index": job.prompt_index * body.n + seq.index,
                        "text": text,
                        "logprobs": None
                        if body.logprobs is None
                        else self._completion_logprobs(seq, 0, len(seq.token_ids), 0, body.logprobs),
                        "finish_reason": seq.finish_reason,
                        "stop_reason": seq.stop_reason,
                    }
                )
        return self._response(request_id, "text_completion", choices, jobs)

    def _prompt_text(self, job: _Job) -> str:
        if job.prompt_text is None:
            job.prompt_text = self.tokenizer.decode(job.prompt_ids, skip_special_tokens=True)
        return job.prompt_text

    def _stream_completion(self, body: CompletionRequest, jobs: list[_Job], request_id: str):
        echoed = [{"index": job.prompt_index * body.n + i, "text": self._prompt_text(job), "logprobs": None,
                   "finish_reason": None} for job in jobs for i in range(body.n)] if body.echo else []

        def choice(job, seq, delta, start, end, text_offset):
            logprobs = None
            if body.logprobs is not None and end > start:
                logprobs = self._completion_logprobs(seq, start, end, text_offset, body.logprobs)
            return {"index": job.prompt_index * body.n + seq.index, "text": delta, "logprobs": logprobs}

        return self._stream(body, jobs, request_id, "text_completion", echoed, choice)

    # ---------------------------------------------------------------- routes: chat
    async def chat(self, body: ChatCompletionRequest, raw: Request):
        arrival = time.monotonic()
        self._check_ready()
        self.check_model(body.model)
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        except Exception as exc:  # noqa: BLE001 - a template refusal is the client's error
            raise bad_request(f"messages could not be rendered by the chat template: {exc}", "messages") from exc
        if not ids:
            raise bad_request("messages render to an empty prompt", "messages")
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._max_tokens(len(ids), requested, None, param, prompt_param="messages")
        top = body.top_logprobs or 0
        params = self.make_params(**self._sampling_kwargs(body, max_tokens, top if body.logprobs else None))
        jobs = [_Job(0, ids, None)]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self._submit(jobs, request_id, params, arrival)
        if body.stream:
            return self._sse(self._stream_chat(body, jobs, request_id), jobs)
        await self._collect(raw, jobs)
        choices = [
            {
                "index": seq.index,
                "message": {"role": "assistant", "content": seq.text},
                "logprobs": {"content": self._chat_logprobs(seq, 0, len(seq.token_ids), top)}
                if body.logprobs
                else None,
                "finish_reason": seq.finish_reason,
                "stop_reason": seq.stop_reason,
            }
            for seq in jobs[0].last.outputs
        ]
        return self._response(request_id, "chat.completion", choices, jobs)

    def _stream_chat(self, body: ChatCompletionRequest, jobs: list[_Job], request_id: str):
        top = body.top_logprobs or 0
        roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(body.n)]

        def choice(job, seq, delta, start, end, text_offset):
            logprobs = None
            if body.logprobs and end > start:
                logprobs = {"content": self._chat_logprobs(seq, start, end, top)}
            return {"index": seq.index, "delta": {"content": delta} if delta else {}, "logprobs": logprobs}

        return self._stream(body, jobs, request_id, "chat.completion.chunk", roles, choice)

    # ---------------------------------------------------------------- responses
    def _response(self, request_id: str, obj: str, choices: list[dict], jobs: list[_Job]) -> JSONResponse:
        return JSONResponse({"id": request_id, "object": obj, "created": int(time.time()),
                             "model": self.model_name, "choices": choices, "usage": self._usage(jobs)})

    async def _stream(self, body, jobs: list[_Job], request_id: str, obj: str, first_choices: list[dict],
                      make_choice):
        """The SSE stream both routes share. One cursor per (prompt, completion) holds back text that might
        still become a stop string; `make_choice(job, seq, delta, start, end, text_offset)` shapes a choice
        for its route (tokens [start, end) are new in this chunk), and the loop adds the finish fields."""
        created = int(time.time())
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        options = body.stream_options or StreamOptions()
        cursors: dict[tuple[int, int], _ChoiceCursor] = {}

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            payload = {"id": request_id, "object": obj, "created": created, "model": self.model_name,
                       "choices": choices}
            if options.include_usage:
                payload["usage"] = usage
            return _sse_event(payload)

        if first_choices:
            yield chunk(first_choices)
        async for job, snap in self._merged(jobs):
            job.last = snap
            choices = []
            for seq in snap.outputs:
                cursor = cursors.setdefault((job.prompt_index, seq.index), _ChoiceCursor())
                if cursor.finished:
                    continue
                final = seq.finish_reason is not None
                delta = cursor.advance(seq.text, final, stops)
                start, end = cursor.sent_tokens, len(seq.token_ids)
                if not delta and not final and end == start:
                    continue
                choice = make_choice(job, seq, delta, start, end, cursor.sent_chars - len(delta))
                choice.update(finish_reason=seq.finish_reason, stop_reason=seq.stop_reason if final else None)
                choices.append(choice)
                cursor.sent_tokens, cursor.finished = end, final
            if choices:
                yield chunk(choices, self._usage(jobs) if options.continuous_usage_stats else None)
        if options.include_usage:
            yield chunk([], self._usage(jobs))

    # ---------------------------------------------------------------- plumbing
    def _check_ready(self) -> None:
        try:
            self.engine.check_ready()
        except (EngineNotReady, EngineDead) as exc:
            raise engine_error(exc) from exc

    def _sse(self, events, jobs: list[_Job]) -> StreamingResponse:
        async def guarded():
            try:
                async for event in events:
                    yield event
            except APIError as exc:
                yield _sse_event(exc.body())
            except (EngineDead, RequestRejected, QueueFull, EngineNotReady) as exc:
                yield _sse_event(engine_error(exc).body())
            except Exception as exc:  # noqa: BLE001 - headers are gone; report in-band
                log.exception("error while streaming")
                yield _sse_event(engine_error(exc).body())
            finally:
                # also reached when the client disconnects (the task is cancelled): abort what still runs
                for job in jobs:
                    job.stream.close()
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            guarded(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def models(self) -> dict:
        self._check_ready()
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "kernel-lab",
                    "root": self.model_path or self.model_name,
                    "max_model_len": self.max_model_len,
                }
            ],
        }

    def health(self) -> JSONResponse:
        state = self.engine.state
        if state == "ready":
            return JSONResponse({"status": "ok"})
        if state in ("created", "starting"):
            return JSONResponse({"status": "starting"}, status_code=503, headers={"Retry-After": "5"})
        return JSONResponse({"status": "dead", "error": repr(self.engine.error)}, status_code=500)

    def metrics_text(self) -> str:
        return self.engine.metrics.render(
            extra_gauges={
                "num_requests_admission_waiting": (
                    "Requests admitted but without a first token (bounded by --max-waiting).",
                    self.engine.num_waiting,
                ),
                "num_requests_in_flight": ("Requests admitted and not finished.", self.engine.num_in_flight),
                "server_ready": (
                    "1 when the engine is loaded and stepping.",
                    int(self.engine.state == "ready"),
                ),
            }
        )


def _sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


def build_app(
    async_engine: AsyncEngine,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    model_path: str | None = None,
    manage_engine: bool = True,
) -> FastAPI:
    """The ASGI app. With manage_engine, the app's lifespan starts the engine thread (which loads the
    model while the server already answers /health with 503) and stops it on shutdown."""
    server = OpenAIServer(async_engine, served_model_name=served_model_name, api_key=api_key, model_path=model_path)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine and async_engine.state == "created":
            async_engine.start(asyncio.get_running_loop())
        yield
        if manage_engine:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    app = FastAPI(title="kernel-lab OpenAI-compatible server", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        return engine_error(exc).response()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await server.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await server.chat(body, raw)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        listing = server.models()
        server.check_model(model_id)
        return listing["data"][0]

    @app.get("/health")
    async def health():
        return server.health()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    return app
