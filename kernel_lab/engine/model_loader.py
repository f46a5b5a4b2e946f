"""Load the model an EngineConfig names: pick the weight path (quantized GGUF blocks or float32 copies,
which depends on the C kernel being usable here), read the weights (or make random ones for a config-only
model), build the model and its tokenizer."""

from __future__ import annotations

import torch

from kernel_lab.models.llama import build_model, random_state_dict
from kernel_lab.models.loader import has_quantized_weights, load_quantized_weights, load_state_dict
from kernel_lab.models.tokenizer import TokenIdsOnly, Tokenizer
from kernel_lab.ops import gguf_linear

from .config import EngineConfig


def load_model(config: EngineConfig):
    """(model, tokenizer). Fills in `config.weights` with the path taken."""
    config.weights = resolve_weight_path(config)
    if config.model_dir is None:
        tokenizer = TokenIdsOnly(config.hf_config)
        weights = random_state_dict(config.model_config, config.dtype, config.device, seed=config.seed)
    else:
        tokenizer = Tokenizer.from_directory(config.model_dir)
        quantized = load_quantized_weights(config.model_dir) if config.weights == "quantized" else {}
        weights = {**load_state_dict(config.model_dir, skip=quantized), **quantized}
    return build_model(config.model_config, weights, config.dtype, config.device, config.max_model_len), tokenizer


def resolve_weight_path(config: EngineConfig) -> str:
    """"quantized" or "float32" for `config.weights` ("auto", "quantized" or "float32")."""
    if config.weights == "float32":
        return "float32"
    blocker = _quantized_blocker(config)
    if blocker and config.weights == "quantized":
        raise ValueError(f"weights='quantized' is not possible here: {blocker}; use weights='float32' or 'auto'")
    if blocker:
        return "float32"
    # auto picks the path measured faster (projects/09_engine/README.md): the vector kernels. The scalar
    # C path is there so the quantized path runs anywhere, not for speed, and was never timed against
    # oneDNN's float32 GEMMs, so auto leaves a CPU without AVX2 on float32.
    if config.weights == "auto" and gguf_linear.kernel_isa() == "scalar":
        return "float32"
    return "quantized"


def _quantized_blocker(config: EngineConfig) -> str | None:
    """Why the quantized path cannot run, or None."""
    if config.device.type != "cpu":
        return f"it runs on the CPU and the device is {config.device.type}"
    if config.dtype != torch.float32:
        return f"it takes float32 activations and dtype is {str(config.dtype).replace('torch.', '')}"
    if not has_quantized_weights(config.model_dir):
        return ("the model has no GGUF tensors in a block format the kernel computes on (Q4_0, Q4_1, Q8_0, Q4_K, "
                "Q5_K, Q6_K; it must be loaded from such a .gguf file)")
    if not gguf_linear.kernel_available():
        return "the C kernel is unavailable (no C compiler, a failed build, or KERNEL_LAB_CPU_KERNELS=0)"
    return None
