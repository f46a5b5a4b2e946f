"""`kernel-lab serve`: build the engine, then run the OpenAI-compatible app under uvicorn (flag names follow
vLLM's)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
import threading
from pathlib import Path

from kernel_lab.engine.arg_utils import add_engine_arguments, engine_kwargs


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients send as `model` (default: the engine's model name)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: loopback only; anything else is reachable from outside)",
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("KERNEL_LAB_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1 routes (env: KERNEL_LAB_API_KEY)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=512,
        help="bound on requests waiting for their first token; beyond it the server answers 429 with Retry-After",
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template (a file, or the template text) in place of the model's")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters (PEFT directories) a request's `model` field selects; needs --enable-lora")
    add_engine_arguments(parser)


class ChatTemplateError(ValueError):
    """--chat-template names a file that cannot be read; `kernel-lab serve` reports it and exits."""


def read_chat_template(spec: str | None) -> str | None:
    """--chat-template: the template text itself when it holds a `{` (every Jinja template does, and a
    path almost never), else a file to read. The path rule is decided by the text, not by whether a file
    exists, so a mistyped path is an error instead of a template that renders every chat as the path, and
    a long inline template never reaches open() (which raises 'File name too long' past 255 bytes)."""
    if spec is None:
        return None
    if "{" in spec:
        return spec
    try:
        return Path(spec).expanduser().read_text()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ChatTemplateError(f"--chat-template {spec!r} has no '{{', so it is read as a file path, and that "
                                f"file cannot be read: {reason}") from None
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(f"--chat-template file {spec!r} is not UTF-8 text: {exc.reason}") from None


def parse_lora_modules(specs: list[str] | None, enable_lora: bool) -> dict[str, str]:
    """--lora-modules NAME=PATH ...: {name: path}; a malformed or repeated entry fails the start
    (ServeArgumentError), before any model loads."""
    modules: dict[str, str] = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ServeArgumentError(f"--lora-modules takes NAME=PATH entries, got {spec!r}")
        if name in modules:
            raise ServeArgumentError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    if modules and not enable_lora:
        raise ServeArgumentError("--lora-modules needs --enable-lora")
    return modules


class ServeArgumentError(ValueError):
    """A `serve` flag's value is unusable; `kernel-lab serve` reports it and exits with status 2."""


def build_server(args):
    """(ASGI app, its AsyncEngine) for parsed `serve` flags; the engine loads when the app starts. run_serve
    runs the app under uvicorn; tests start the same app in-process (server.background)."""
    from .app import build_app
    from .async_engine import AsyncEngine
    from .serving import lora_requests
    from .serving_lora import runtime_updates_allowed

    log = logging.getLogger("kernel_lab.server")
    kwargs = engine_kwargs(args)
    chat_template = read_chat_template(args.chat_template)
    lora_modules = parse_lora_modules(getattr(args, "lora_modules", None), kwargs.get("enable_lora", False))

    def build_engine():
        from kernel_lab.engine import LLMEngine

        log.info("loading the engine: %s", {k: v for k, v in kwargs.items() if v is not None})
        engine = LLMEngine(**kwargs)
        if chat_template is not None:
            engine.tokenizer.set_chat_template(chat_template)
        if engine.config.model_name in lora_modules or (args.served_model_name or "") in lora_modules:
            raise ServeArgumentError("a --lora-modules name must differ from the served model's name")
        for lora in lora_requests(lora_modules).values():  # read and check each now: a bad one fails the start
            engine.lora.register(lora)
        return engine

    async_engine = AsyncEngine(build_engine, max_waiting=args.max_waiting)
    app = build_app(async_engine, served_model_name=args.served_model_name, api_key=args.api_key, model_path=args.model,
                    lora_modules=lora_modules, allow_runtime_lora_updating=runtime_updates_allowed(os.environ))
    return app, async_engine


def run_serve(args) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("kernel_lab.server")
    if not _is_loopback(args.host):
        log.warning(
            "binding to %s: the server is reachable from other machines%s",
            args.host,
            "" if args.api_key else " and has no --api-key",
        )
    if args.max_waiting < 1:
        print("--max-waiting must be at least 1", file=sys.stderr)
        return 2
    try:
        app, async_engine = build_server(args)
    except (ChatTemplateError, ServeArgumentError) as exc:
        print(f"kernel-lab serve: {exc}", file=sys.stderr)
        return 2
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    )
    failed = threading.Event()

    def watch_engine():
        async_engine.ready_event.wait()
        if async_engine.state == "failed":
            log.error("the engine failed to load: %r; shutting down", async_engine.error)
            failed.set()
            server.should_exit = True
        else:
            log.info(
                "ready: http://%s:%d/v1 (model %s)",
                args.host,
                args.port,
                args.served_model_name or async_engine.engine.config.model_name,
            )

    threading.Thread(target=watch_engine, daemon=True, name="engine-watch").start()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    return 1 if failed.is_set() else 0

