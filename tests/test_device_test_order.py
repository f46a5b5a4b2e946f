"""conftest.py puts a GPU machine's device tests first (gpu-marked and extension tests, then those on the
`device` fixture, then CPU-only ones), keeping each group in file order: the GPU suite's deadline cuts a
project's pytest run short, and the first H200 run spent project 04's time on CPU-side tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class FakeItem:
    def __init__(self, name, keywords=(), fixtures=()):
        self.name, self.keywords, self.fixturenames = name, set(keywords), list(fixtures)

    def add_marker(self, marker):
        self.keywords.add(marker.name)


def load_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_on_a_gpu_device_tests_run_first_in_file_order(monkeypatch):
    conftest = load_conftest()
    monkeypatch.setattr(conftest, "HAS_CUDA", True)
    items = [FakeItem("cpu_a"), FakeItem("dev_a", fixtures=["device"]), FakeItem("gpu_a", keywords=["gpu"]),
             FakeItem("cpu_b", fixtures=["c_kernels_only"]), FakeItem("gpu_b", keywords=["gpu"]),
             FakeItem("dev_b", fixtures=["device", "monkeypatch"])]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.name for i in items] == ["gpu_a", "gpu_b", "dev_a", "dev_b", "cpu_a", "cpu_b"]


def test_without_a_gpu_the_order_is_left_alone(monkeypatch):
    conftest = load_conftest()
    monkeypatch.setattr(conftest, "HAS_CUDA", False)
    items = [FakeItem("cpu_a"), FakeItem("gpu_a", keywords=["gpu"]), FakeItem("dev_a", fixtures=["device"])]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.name for i in items] == ["cpu_a", "gpu_a", "dev_a"]
    assert "skip" in items[1].keywords
