"""Request preparation off the event loop: tokenizing prompts and rendering chat templates run on a small
thread pool, so `/health`, `/metrics` and every open stream keep answering while a large request is
prepared. Grammars compile on the grammar service's own threads (cached by their spec); a request waiting
for one holds a slot here too.

The pool is bounded twice: `max_workers` threads, and at most `max_pending` jobs admitted (running, queued,
or a compile being waited for; the app passes `--max-waiting`). A request beyond that is refused at once
with 429 and Retry-After instead of being queued, so a flood of large requests cannot pile up. A slot is
freed when its job ends: a queued job whose client went away is dropped, a running one keeps its thread and
its slot until it finishes, and a grammar compile is never cancelled (other requests may share its cached result).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from .protocol import APIError

T = TypeVar("T")


class PreparationPool:
    def __init__(self, max_workers: int = 2, max_pending: int = 512):
        if max_workers < 1 or max_pending < max_workers:
            raise ValueError(f"need max_workers >= 1 and max_pending >= max_workers, got {max_workers}, "
                             f"{max_pending}")
        self.max_pending = max_pending
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kl-prepare")
        self._slots = threading.BoundedSemaphore(max_pending)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on a worker thread; its exception (an APIError for the client's input) is raised here."""
        self._admit()
        try:
            future = self._pool.submit(fn, *args)
        except BaseException:
            self._slots.release()
            raise
        return await self._held_until_done(future)

    async def wait(self, future: Future[T]) -> T:
        """Wait for work another pool does for a request (a grammar compile), holding a slot of this one
        until it is done, so the bound covers every kind of preparation."""
        self._admit()
        return await asyncio.shield(self._held_until_done(future))

    def _admit(self) -> None:
        if not self._slots.acquire(blocking=False):
            raise APIError(429, f"{self.max_pending} requests are already being prepared; retry after 1 s",
                           type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})

    async def _held_until_done(self, future: Future[T]) -> T:
        future.add_done_callback(lambda _: self._slots.release())
        return await asyncio.wrap_future(future)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
