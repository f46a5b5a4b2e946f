"""Fixtures for the server tests: servers on 127.0.0.1 with an ephemeral port, in a background thread.

- `fake_server(...)`: a factory for servers around fake_engine.FakeEngine (milliseconds per request).
- `live_server`: one server around the real default model per test module (skipped when
  kernel_lab.engine is not importable), with the PyTorch reference path on CPU (TRITON_INTERPRET=0:
  interpreting every kernel of a 30-layer model would take minutes).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

# The web stack (fastapi, uvicorn, httpx, openai) is imported only where a fixture uses it: the bare GPU box
# has none of it, and each test module here then skips itself (pytest.importorskip) instead of stopping
# the collection of the whole suite.
HERE = Path(__file__).resolve().parent


@functools.cache
def _http():
    import httpx

    return httpx.Client(timeout=30)


def metric_values(url: str) -> dict[tuple[str, tuple], float]:
    """GET /metrics parsed by prometheus_client's own parser (a malformed exposition fails here), keyed by
    (sample name, sorted labels without model_name)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(_http().get(url + "/metrics").text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values[(sample.name, labels)] = sample.value
    return values


@pytest.fixture
def read_metrics():
    pytest.importorskip("httpx")
    pytest.importorskip("prometheus_client")
    return metric_values


def _load_fake_engine():
    name = "kernel_lab_server_tests_fake_engine"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "fake_engine.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


fake_engine = _load_fake_engine()


class RunningServer:
    def __init__(self, background, async_engine, api_key: str | None):
        self.background = background
        self.async_engine = async_engine
        self.api_key = api_key

    @property
    def url(self) -> str:
        return self.background.url

    @property
    def engine(self):
        return self.async_engine.engine

    def client(self, **kwargs):
        import openai

        api_key = kwargs.pop("api_key", self.api_key or "unused")
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=kwargs.pop("timeout", 60), **kwargs
        )

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        if not self.async_engine.ready_event.wait(timeout_s):
            raise TimeoutError("the engine did not load in time")
        if self.async_engine.state != "ready":
            raise RuntimeError(f"the engine failed to load: {self.async_engine.error!r}")

    def wait_idle(self, timeout_s: float = 30.0) -> dict:
        """Wait until the engine thread has nothing in flight; returns engine.stats()."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = self.async_engine.metrics.snapshot()
            if (
                self.async_engine.num_in_flight == 0
                and stats["num_requests_running"] == 0
                and stats["num_requests_waiting"] == 0
                and stats["kv_cache_blocks_free"] == stats["kv_cache_blocks_total"]
            ):
                return stats
            time.sleep(0.02)
        raise TimeoutError(f"the engine is not idle: {self.async_engine.metrics.snapshot()}")


def start_server(
    factory,
    *,
    max_waiting: int = 512,
    api_key: str | None = None,
    served_model_name: str | None = None,
) -> RunningServer:
    from kernel_lab.server.app import build_app
    from kernel_lab.server.async_engine import AsyncEngine
    from kernel_lab.server.background import BackgroundServer

    async_engine = AsyncEngine(factory, max_waiting=max_waiting)
    app = build_app(async_engine, api_key=api_key, served_model_name=served_model_name)
    background = BackgroundServer(app).start()
    return RunningServer(background, async_engine, api_key)


@pytest.fixture
def fake_server():
    for module in ("fastapi", "uvicorn"):
        pytest.importorskip(module)
    started: list[RunningServer] = []

    def make(*, max_waiting: int = 512, api_key: str | None = None, wait: bool = True, **engine_kwargs):
        server = start_server(
            lambda: fake_engine.FakeEngine(**engine_kwargs),
            max_waiting=max_waiting,
            api_key=api_key,
        )
        started.append(server)
        if wait:
            server.wait_ready(10)
        return server

    yield make
    for server in started:
        server.background.stop()


def _real_engine_available() -> str | None:
    try:
        from kernel_lab.engine import LLMEngine  # noqa: F401
        from kernel_lab.models.gguf import default_model_path

        default_model_path()
    except Exception as exc:  # noqa: BLE001 - any reason is a reason to skip
        return f"the real engine is not available: {exc!r}"
    return None


# Small enough for a 2-core CPU, big enough for the load test's 256 clients to queue.
LIVE_ENGINE_KWARGS = dict(max_model_len=512, max_num_seqs=64, dtype="float32", device="cpu")
LIVE_API_KEY = "test-key-123"


# Module scope, not session: the fixture switches TRITON_INTERPRET to 0 for as long as the server runs, and
# that must not leak into other projects' tests that run later in the same pytest process.
@pytest.fixture(scope="module")
def live_server():
    reason = _real_engine_available()
    if reason:
        pytest.skip(reason)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"

    def factory():
        from kernel_lab.engine import LLMEngine

        return LLMEngine(**LIVE_ENGINE_KWARGS)

    server = start_server(factory, max_waiting=1024, api_key=LIVE_API_KEY)
    try:
        server.wait_ready(180)
        yield server
    finally:
        server.background.stop()
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
