"""Shared fixtures for tests that run a real engine on a 2-core CPU (engine, CLI and server tests)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Run a test module with one PyTorch intra-op thread, then restore. On a shared 2-core machine two
    spinning OpenMP threads slow every step by up to 10x whenever another process takes a core; one thread
    costs less than 2x on an idle machine and stays predictable, which is what a timed test suite needs."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
