"""Shared settings for tests that need a real engine on a 2-core CPU (engine and server tests)."""

from __future__ import annotations

import contextlib


def small_engine_kwargs(**overrides) -> dict:
    """LLMEngine keyword arguments for the bundled model on CPU, fp32, with a small KV pool: quick to build
    (the export is cached after the first run) and small enough to exercise preemption under load."""
    kwargs = dict(device="cpu", dtype="float32", max_model_len=512, max_num_seqs=16, num_kv_blocks=256,
                  block_size=16)
    kwargs.update(overrides)
    return kwargs


@contextlib.contextmanager
def one_intra_op_thread():
    """Run with one PyTorch intra-op thread, then restore. On a shared 2-core machine two spinning OpenMP
    threads slow every step by up to 10x whenever another process takes a core; one thread costs less
    than 2x on an idle machine and stays predictable, which is what a timed test suite needs."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
