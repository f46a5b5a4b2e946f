"""One engine loop on its own thread, fed by thread-safe queues, feeding asyncio streams.

The engine (anything with the `kernel_lab.engine.interface.Engine` surface: LLMEngine, or the tests' fake)
is single-threaded. It is built and stepped on one dedicated thread, which owns it outright. Request
handlers on the event loop never call it: they put `add`/`abort` commands on a `queue.SimpleQueue`, which
the engine thread drains between steps. Requests run with RequestOutputKind.DELTA, so each step's outputs
hold only their new text, token ids and logprobs, objects the engine never touches again: the engine thread
forwards them as they are, counts their tokens for the metrics, and hands the whole batch to the event loop
with one `loop.call_soon_threadsafe`, which puts each output on its request's `asyncio.Queue`. So a handler
waiting for tokens costs the engine nothing, a step costs the server the same at token 2,000 as at token 2,
and a slow client only makes its own queue longer; a consumer merges the deltas queued since its last read
(`merge_deltas`) in one pass, so a backlog never turns into a backlog of work.

Admission control lives on the event loop: a request counts as *waiting* from submission until its first
token arrives; when `max_waiting` requests are waiting, new ones are refused with QueueFull (HTTP 429).
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from typing import Any, Callable

from kernel_lab.engine.errors import error_param, is_client_error
from kernel_lab.engine.interface import Engine
from kernel_lab.engine.outputs import RequestOutput, merge_deltas
from kernel_lab.engine.sampling_params import RequestOutputKind, SamplingParams

from .metrics import ServerMetrics

log = logging.getLogger("kernel_lab.server")


class EngineNotReady(RuntimeError):
    """The engine is still loading (HTTP 503)."""


class EngineDead(RuntimeError):
    """The engine failed to load or crashed in a step (HTTP 500)."""


class QueueFull(RuntimeError):
    """The bounded waiting queue is full (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestRejected(ValueError):
    """The engine refused the request in add_request, or later (its grammar failed, or a value of it failed
    in a step): HTTP 400. `param` is the request field the engine's error names, if any."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestFailed(RuntimeError):
    """The engine failed on this request alone (HTTP 500); it still serves the others."""


def request_error(exc: BaseException) -> RequestRejected | RequestFailed:
    """What the client of a request the engine ended with `exc` is told: its fault (400) or the engine's."""
    if is_client_error(exc):
        return RequestRejected(str(exc), error_param(exc))
    return RequestFailed(f"the engine failed on this request: {exc!r}")


class _Tracked:
    """Engine-thread bookkeeping for one request (timings for the metrics)."""

    __slots__ = ("arrival", "prompt_tokens", "first_token_at", "last_token_at", "generated")

    def __init__(self, arrival: float, prompt_tokens: int):
        self.arrival = arrival
        self.prompt_tokens = prompt_tokens
        self.first_token_at: float | None = None
        self.last_token_at: dict[int, float] = {}
        self.generated = 0


class RequestStream:
    """Async iterator over one request's outputs (deltas). Leaving it early (break, exception, cancellation)
    must end in `close()`, which aborts the request in the engine; the server does that in a finally."""

    def __init__(self, engine: AsyncEngine, request_id: str):
        self._engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.waiting = True
        self.done = False
        # set by the engine thread once add_request ran: None (taken) or the refusal
        self.admission: asyncio.Future = asyncio.get_running_loop().create_future()

    async def admitted(self) -> None:
        """Wait until the engine took the request; raise its refusal (RequestRejected, RequestFailed)."""
        refusal = await self.admission
        if refusal is not None:
            raise refusal

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        deltas = []
        while isinstance(item, RequestOutput):
            deltas.append(item)
            if self.queue.empty():
                item = merge_deltas(deltas)  # everything new since the consumer's last read
                break
            item = self.queue.get_nowait()
        if item is _CLOSED:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finished:
            self.done = True
        return item

    def close(self) -> None:
        """Abort the request unless it already finished, and wake a consumer still waiting on the stream
        (it then ends). Safe to call more than once."""
        if not self.done:
            self.done = True
            self._engine._abort(self.request_id)
            self.queue.put_nowait(_CLOSED)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():  # the caller was cancelled
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)


_CLOSED = object()  # queued by RequestStream.close() so a waiting consumer stops
_ADMITTED = object()  # posted by the engine thread once add_request took a request


class AsyncEngine:
    def __init__(
        self,
        engine_factory: Callable[[], Any],
        *,
        max_waiting: int = 512,
        metrics: ServerMetrics | None = None,
    ):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        self._factory = engine_factory
        self.max_waiting = max_waiting
        self.metrics = metrics or ServerMetrics()
        self.engine = None
        self.state = "created"  # created -> starting -> ready -> (failed | stopped)
        self.error: BaseException | None = None
        self.ready_event = threading.Event()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._resume = threading.Event()
        self._resume.set()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # event-loop side
        self._streams: dict[str, RequestStream] = {}
        self._num_waiting = 0
        # engine-thread side
        self._tracked: dict[str, _Tracked] = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self.state = "starting"
        self._thread = threading.Thread(target=self._run, name="kernel-lab-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._resume.set()
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.state == "ready":
            self.state = "stopped"

    def pause(self) -> None:
        """Stop stepping (commands still queue up). For tests and maintenance."""
        self._resume.clear()

    def resume(self) -> None:
        self._resume.set()
        self._commands.put(("wake",))

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def check_ready(self) -> None:
        if self.state == "ready":
            return
        if self.state in ("failed", "stopped"):
            raise EngineDead(
                f"the engine is not running: {self.error!r}" if self.error else "the engine is not running"
            )
        raise EngineNotReady("the model is still loading; retry shortly")

    # ------------------------------------------------------------------ event-loop API
    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival: float | None = None,
        lora_request=None,
    ) -> RequestStream:
        """Queue a request (its params with output_kind=DELTA) for the engine thread. Raises EngineNotReady,
        EngineDead or QueueFull at once; an engine-side refusal (RequestRejected) arrives through the stream."""
        if params.output_kind is not RequestOutputKind.DELTA:
            raise ValueError("the server's requests stream deltas: SamplingParams(output_kind=DELTA)")
        self.check_ready()
        if self._num_waiting >= self.max_waiting:
            raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests)", self.retry_after_s())
        if request_id in self._streams:
            raise RequestRejected(f"request id {request_id!r} is already in flight")
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        self._num_waiting += 1
        self._commands.put(
            (
                "add",
                request_id,
                list(prompt_token_ids),
                params,
                time.monotonic() if arrival is None else arrival,
                lora_request,
            )
        )
        return stream

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(engine) on the engine thread between two steps (the engine is single-threaded; the LoRA
        load/unload routes use this): its result, or the exception it raised."""
        self.check_ready()
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", fn, future))
        return await future

    def retry_after_s(self) -> int:
        """A hint for Retry-After: about one mean request latency, 1 to 60 s."""
        hist = self.metrics.e2e
        mean = hist.sum / hist.count if hist.count else 1.0
        return int(min(60, max(1, math.ceil(mean))))

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None and stream.waiting:
            stream.waiting = False
            self._num_waiting -= 1
        self._commands.put(("abort", request_id))

    def _deliver(self, batch: list[tuple[str, Any]]) -> None:
        for request_id, item in batch:
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # aborted while the step ran
            if item is _ADMITTED or isinstance(item, BaseException):
                if not stream.admission.done():
                    stream.admission.set_result(None if item is _ADMITTED else item)
                if item is _ADMITTED:
                    continue
            if stream.waiting:
                stream.waiting = False
                self._num_waiting -= 1
            if isinstance(item, BaseException) or item.finished:
                del self._streams[request_id]
            stream.queue.put_nowait(item)

    def _fail_all(self, exc: BaseException) -> None:
        self._deliver([(rid, exc) for rid in list(self._streams)])

    # ------------------------------------------------------------------ engine thread
    def _post(self, batch: list) -> None:
        if batch and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._deliver, batch)
            except RuntimeError:  # loop closed during shutdown
                pass

    def _run(self) -> None:
        try:
            engine = self._factory()
        except BaseException as exc:  # noqa: BLE001 - reported through /health and every request
            log.exception("engine failed to load")
            self.error, self.state = exc, "failed"
            self.ready_event.set()
            return
        self.engine: Engine = engine
        if not self.metrics.model_name:
            self.metrics.model_name = engine.config.model_name
        self.metrics.on_step(engine.stats())
        self.state = "ready"
        self.ready_event.set()
        try:
            self._serve(engine)
        except BaseException as exc:  # noqa: BLE001
            log.exception("engine loop crashed")
            self.error, self.state = exc, "failed"
            dead = EngineDead(f"the engine crashed: {exc!r}")
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, dead)
        # a call() still queued would wait forever: it gets the engine's end instead
        while self._loop is not None and not self._loop.is_closed():
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "call":
                self._loop.call_soon_threadsafe(_settle, command[2], None, EngineDead("the engine is not running"))

    def _apply(self, engine, command: tuple, errors: list) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt_ids, params, arrival, lora = command
            try:
                # the keyword only where an adapter is named: engines without LoRA keep their signature
                engine.add_request(request_id, prompt_ids, params, **({"lora_request": lora} if lora else {}))
            except Exception as exc:  # noqa: BLE001 - one bad request must not kill the loop
                if not is_client_error(exc):
                    log.exception("add_request failed for %s", request_id)
                errors.append((request_id, request_error(exc)))
                return
            self._tracked[request_id] = _Tracked(arrival, len(prompt_ids))
            errors.append((request_id, _ADMITTED))
        elif kind == "call":
            _, fn, future = command
            try:
                outcome = (fn(engine), None)
            except Exception as exc:  # noqa: BLE001 - the caller gets it; the loop goes on
                outcome = (None, exc)
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(_settle, future, *outcome)
        elif kind == "abort":
            request_id = command[1]
            tracked = self._tracked.pop(request_id, None)
            if tracked is not None:
                engine.abort_request(request_id)
                self.metrics.on_finished("abort", time.monotonic() - tracked.arrival, tracked.prompt_tokens,
                                         tracked.generated)

    def _serve(self, engine) -> None:
        while not self._stop.is_set():
            busy = engine.has_unfinished_requests() and self._resume.is_set()
            commands = []
            try:
                commands.append(self._commands.get(block=not busy, timeout=None if busy else 0.5))
            except queue.Empty:
                pass
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            errors: list = []
            for command in commands:
                self._apply(engine, command, errors)
            self._post(errors)
            if commands:
                self.metrics.on_step(engine.stats())
            if self._stop.is_set() or not self._resume.is_set() or not engine.has_unfinished_requests():
                continue
            batch = self._forward(engine.step(), time.monotonic())
            self.metrics.on_step(engine.stats())
            self._post(batch)
        for request_id in list(self._tracked):
            engine.abort_request(request_id)
        self._tracked.clear()

    def _forward(self, outputs: list[RequestOutput], now: float) -> list[tuple[str, RequestOutput]]:
        """The one loop over a step's outputs on the server side: count their new tokens for the metrics
        and pass them on unchanged."""
        metrics, batch = self.metrics, []
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            if output.error is not None:
                del self._tracked[output.request_id]
                batch.append((output.request_id, request_error(output.error)))
                continue
            for completion in output.outputs:
                new = len(completion.token_ids)
                if not new:
                    continue
                if tracked.first_token_at is None:
                    tracked.first_token_at = now
                    metrics.on_first_token(now - tracked.arrival, tracked.prompt_tokens)
                previous = tracked.last_token_at.get(completion.index)
                metrics.on_tokens(new, None if previous is None else now - previous)
                tracked.last_token_at[completion.index] = now
                tracked.generated += new
            if output.finished:
                del self._tracked[output.request_id]
                reasons = {c.finish_reason for c in output.outputs}
                metrics.on_finished("length" if "length" in reasons else "stop", now - tracked.arrival,
                                    tracked.prompt_tokens, tracked.generated)
            batch.append((output.request_id, output))
        return batch
