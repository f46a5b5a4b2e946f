"""The OpenAI-compatible ASGI app: one module per endpoint, assembled here, with the error handlers, the
API-key check and the engine's lifespan.

    POST /v1/completions        legacy completions              serving_completion.py
    POST /v1/chat/completions   chat, through the chat template  serving_chat.py
    POST /tokenize, /detokenize vLLM's shapes                   serving_tokenization.py
    GET  /v1/models             the served model and its LoRA adapters (--lora-modules)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   with VLLM_ALLOW_RUNTIME_LORA_UPDATING  serving_lora.py
    GET  /health                200 ready, 503 still loading, 500 engine dead
    GET  /metrics               Prometheus text format (see metrics.py)

Both generation routes stream (Server-Sent Events ending in `data: [DONE]`, with
`stream_options.include_usage`) or answer in one JSON body (schemas and errors: protocol.py). A new endpoint
is a new module with an OpenAIServing subclass and an `add_routes(app, serving)`, listed in ENDPOINTS.

Tokenizing and chat-template rendering run on a bounded thread pool (preparation.py), never on the event
loop, so /health and open streams keep answering while a large request is prepared.

Error statuses: 400 malformed JSON / bad parameter / prompt too long / unusable LoRA adapter, 401 bad key,
404 unknown model, adapter or route, 409 unloading an adapter requests still use, 429 (with Retry-After)
waiting queue or preparation pool full, 500 engine failure, 503 model still loading.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import serving_chat, serving_completion, serving_lora, serving_tokenization
from .async_engine import AsyncEngine
from .preparation import PreparationPool
from .protocol import APIError, bad_request, engine_error, validation_message
from .serving import OpenAIServing, lora_requests

ENDPOINTS = ((serving_completion, serving_completion.CompletionServing), (serving_chat, serving_chat.ChatServing),
             (serving_tokenization, serving_tokenization.TokenizationServing))


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
                error = APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def models(serving: OpenAIServing) -> dict:
    """The base model, then each --lora-modules adapter with the base as its `parent` (vLLM's listing)."""
    serving.check_ready()
    base = {"id": serving.model_name, "object": "model", "created": serving.created, "owned_by": "kernel-lab",
            "root": serving.model_path or serving.model_name, "parent": None, "max_model_len": serving.max_model_len}
    adapters = [{**base, "id": name, "root": str(lora.lora_path), "parent": serving.model_name}
                for name, lora in serving.lora_requests.items()]
    return {"object": "list", "data": [base, *adapters]}


def health(async_engine: AsyncEngine) -> JSONResponse:
    state = async_engine.state
    if state == "ready":
        return JSONResponse({"status": "ok"})
    if state in ("created", "starting"):
        return JSONResponse({"status": "starting"}, status_code=503, headers={"Retry-After": "5"})
    return JSONResponse({"status": "dead", "error": repr(async_engine.error)}, status_code=500)


def metrics_text(async_engine: AsyncEngine) -> str:
    return async_engine.metrics.render(extra_gauges={
        "num_requests_admission_waiting": ("Requests admitted but without a first token (bounded by --max-waiting).",
                                           async_engine.num_waiting),
        "num_requests_in_flight": ("Requests admitted and not finished.", async_engine.num_in_flight),
        "server_ready": ("1 when the engine is loaded and stepping.", int(async_engine.state == "ready")),
    })


def build_app(async_engine: AsyncEngine, *, served_model_name: str | None = None, api_key: str | None = None,
              model_path: str | None = None, manage_engine: bool = True,
              lora_modules: dict[str, str] | None = None, allow_runtime_lora_updating: bool = False) -> FastAPI:
    """The ASGI app. With manage_engine, the app's lifespan starts the engine thread (which loads the
    model while the server already answers /health with 503) and stops it on shutdown.
    allow_runtime_lora_updating adds POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""

    # A request being prepared is as much a waiting request as one queued for its first token: one bound,
    # --max-waiting, covers both (each job's text is already bounded by the prompt character limit).
    preparation = PreparationPool(max_pending=async_engine.max_waiting)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine and async_engine.state == "created":
            async_engine.start(asyncio.get_running_loop())
        yield
        preparation.shutdown()
        if manage_engine:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    app = FastAPI(title="kernel-lab OpenAI-compatible server", lifespan=lifespan)
    facts = dict(served_model_name=served_model_name, model_path=model_path, preparation=preparation,
                 lora_requests_by_name=lora_requests(lora_modules))
    for module, serving_class in ENDPOINTS:
        module.add_routes(app, serving_class(async_engine, **facts))
    if allow_runtime_lora_updating:
        serving_lora.add_routes(app, serving_lora.LoRAServing(async_engine, **facts))
    server = OpenAIServing(async_engine, **facts)

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

    @app.get("/v1/models")
    async def list_models():
        return models(server)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        listing = models(server)
        server.check_model(model_id)
        return next(m for m in listing["data"] if m["id"] == model_id)

    @app.get("/health")
    async def get_health():
        return health(async_engine)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(metrics_text(async_engine), media_type="text/plain; version=0.0.4; charset=utf-8")

    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    return app
