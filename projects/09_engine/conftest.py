"""Shared fixtures for tests that run a real engine on a 2-core CPU (engine, CLI and server tests), and the
bundled model's availability (the bare GPU box has neither the model package nor gguf and tokenizers)."""

from __future__ import annotations

import functools

import pytest

# SmolLM2-135M-Instruct's shape, for random-weight engines where the bundled model is not installed.
SMOLLM2_135M_SHAPE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "eos_token_id": 2,
}


@functools.cache
def bundled_model_missing() -> str | None:
    """Why the bundled model cannot be loaded here (None when it can): its package, gguf or tokenizers."""
    try:
        import gguf  # noqa: F401
        import tokenizers  # noqa: F401

        from kernel_lab.models.gguf import default_model_path

        default_model_path()
    except (ImportError, FileNotFoundError) as exc:
        return f"the bundled model cannot be loaded on this machine: {exc}"
    return None


@pytest.fixture(scope="module")
def bundled_model():
    """Skip a test that needs the bundled SmolLM2 (and its tokenizer) where it is not installed."""
    reason = bundled_model_missing()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def engine_model():
    """LLMEngine's model argument for tests that need no trained weights (the GPU tests): None, the bundled
    model, where it loads; else its shape, with random weights."""
    return None if bundled_model_missing() is None else SMOLLM2_135M_SHAPE


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


@pytest.fixture(scope="session")
def make_gguf():
    """make_1b_gguf.py as a module: random Llama GGUFs (F16, random blocks of any kernel format, or
    quantized by llama.cpp where .venv-llamacpp exists)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("make_1b_gguf", Path(__file__).parent / "make_1b_gguf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
