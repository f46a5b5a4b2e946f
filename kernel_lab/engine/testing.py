"""Shared settings for tests that need a real engine on a 2-core CPU (engine and server tests)."""

from __future__ import annotations


def small_engine_kwargs(**overrides) -> dict:
    """LLMEngine keyword arguments for the bundled model on CPU, fp32, with a small KV pool: quick to build
    (the export is cached after the first run) and small enough to exercise preemption under load."""
    kwargs = dict(device="cpu", dtype="float32", max_model_len=512, max_num_seqs=16, num_kv_blocks=256,
                  block_size=16)
    kwargs.update(overrides)
    return kwargs
