"""EngineConfig: the engine's constructor arguments, validated, with device, dtypes and the KV pool size
resolved. Everything that can be wrong with a configuration is found here, before any weight is loaded."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernel_lab.models.llama import ModelConfig
from kernel_lab.models.loader import has_quantized_weights, load_config, resolve_model_dir
from kernel_lab.ops.kv_cache import FP8_DTYPE, SUPPORTED_BLOCK_SIZES, kv_cache_bytes

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
GRAPH_MEMORY_RESERVE_BYTES = 512 << 20
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
_KV_DTYPES = {"fp8": FP8_DTYPE, "fp8_e4m3": FP8_DTYPE}
WEIGHT_CHOICES = ("auto", "quantized", "float32")


def resolve_device(device) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device}")
    return device


def resolve_dtype(dtype, device: torch.device, hf_config: dict) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype in (None, "auto"):
        if device.type == "cpu":
            resolved = torch.float32  # no native bf16 on the CPUs we target; fp32 is also the parity dtype
        else:
            stored = _DTYPES.get(str(hf_config.get("torch_dtype") or hf_config.get("dtype")), torch.bfloat16)
            resolved = stored if stored != torch.float32 else torch.bfloat16
    elif dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {resolved}")
    if device.type == "cuda" and resolved == torch.float32:
        raise ValueError("dtype float32 is not supported on CUDA: the paged attention kernel takes fp16/bf16")
    return resolved


@dataclass
class EngineConfig:
    """`model`: None (the bundled SmolLM2-135M-Instruct), a GGUF file or Hugging Face directory, or a
    config.json as a dict (random weights, token-id prompts only). After construction `device`, `dtype` and
    `kv_cache_dtype` hold torch objects and `max_num_batched_tokens` a number; `num_kv_blocks` is filled
    by `resolve_num_kv_blocks` once the model is built (on CUDA the default depends on its activations).

    `weights`: "quantized" computes on a GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K blocks (CPU, float32
    activations, the C kernel of ops/gguf_linear.py); "float32" on dequantized float32 copies; "auto"
    (default) picks quantized wherever it applies, the faster path in projects/09_engine's measurements.
    After construction it holds the path taken."""

    model: str | dict | None = None
    dtype: str | torch.dtype = "auto"
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_dtype: str | torch.dtype = "auto"
    enable_prefix_caching: bool = True
    device: str | torch.device = "auto"
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    seed: int = 0
    pad_decode_batches: bool = False
    weights: str = "auto"
    model_dir: Path | None = field(init=False, default=None)
    hf_config: dict = field(init=False, repr=False, default_factory=dict)
    model_config: ModelConfig = field(init=False, repr=False, default=None)
    model_name: str = field(init=False, default="")

    def __post_init__(self):
        if isinstance(self.model, dict):
            self.hf_config = self.model
        else:
            self.model_dir = resolve_model_dir(self.model, float_weights=False)  # a GGUF's tensors are read in place
            self.hf_config = load_config(self.model_dir)
        self.model_config = config = ModelConfig.from_hf(self.hf_config)
        self.model_name = _model_name(self.model, self.model_dir)

        for name in ("max_model_len", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"{config.max_position_embeddings}")
        if config.sliding_window and self.max_model_len > config.sliding_window:
            raise ValueError(f"sliding-window attention is not implemented: use max_model_len <= "
                             f"{config.sliding_window} (the model's sliding_window)")
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {self.block_size!r}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(2048, self.max_num_seqs)
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens must be an integer >= max_num_seqs ({self.max_num_seqs}), "
                             f"got {self.max_num_batched_tokens!r}")
        if self.kv_cache_dtype not in ("auto", *_KV_DTYPES):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")

        if self.weights not in WEIGHT_CHOICES:
            raise ValueError(f"weights must be one of {WEIGHT_CHOICES}, got {self.weights!r}")

        self.device = resolve_device(self.device)
        self.dtype = resolve_dtype(self.dtype, self.device, self.hf_config)
        self.kv_cache_dtype = self.dtype if self.kv_cache_dtype == "auto" else _KV_DTYPES[self.kv_cache_dtype]
        self.weights = self._resolve_weights()

    def _resolve_weights(self) -> str:
        if self.weights == "float32":
            return "float32"
        blocker = self._quantized_blocker()
        if blocker and self.weights == "quantized":
            raise ValueError(f"weights='quantized' is not possible here: {blocker}; use weights='float32' "
                             "or 'auto'")
        if blocker:
            return "float32"
        from kernel_lab.ops import gguf_linear

        # auto picks the path measured faster (projects/09_engine/README.md): the vector kernels. The scalar
        # C path is there so the quantized path runs anywhere, not for speed, and was never timed against
        # oneDNN's float32 GEMMs, so auto leaves a CPU without AVX2 on float32.
        if self.weights == "auto" and gguf_linear.kernel_isa() == "scalar":
            return "float32"
        return "quantized"

    def _quantized_blocker(self) -> str | None:
        """Why the quantized path cannot run, or None."""
        if self.device.type != "cpu":
            return f"it runs on the CPU and the device is {self.device.type}"
        if self.dtype != torch.float32:
            return f"it takes float32 activations and dtype is {str(self.dtype).replace('torch.', '')}"
        if not has_quantized_weights(self.model_dir):
            return ("the model has no GGUF tensors in a block format the kernel computes on (Q4_0, Q4_1, Q8_0, Q4_K, "
                    "Q5_K, Q6_K; it must be loaded from such a .gguf file)")
        from kernel_lab.ops.gguf_linear import kernel_available

        if not kernel_available():
            return "the C kernel is unavailable (no C compiler, a failed build, or KERNEL_LAB_CPU_KERNELS=0)"
        return None

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def use_cuda_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.enforce_eager

    def kv_bytes_per_block(self) -> int:
        c = self.model_config
        return c.num_layers * kv_cache_bytes(1, self.block_size, c.num_kv_heads, c.head_dim, self.kv_cache_dtype)

    def resolve_num_kv_blocks(self, model) -> int:
        """Fill in `num_kv_blocks` (default: what every running sequence can use at full length, within
        the memory budget) and check that one sequence of max_model_len tokens fits."""
        if self.num_kv_blocks is None:
            self.num_kv_blocks = self._default_num_kv_blocks(model)
        if not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < self.blocks_per_seq:
            raise ValueError(f"num_kv_blocks ({self.num_kv_blocks}) must hold at least one sequence of "
                             f"max_model_len tokens: >= {self.blocks_per_seq} blocks of {self.block_size}")
        return self.num_kv_blocks

    def _default_num_kv_blocks(self, model) -> int:
        per_block = self.kv_bytes_per_block()
        useful = self.max_num_seqs * self.blocks_per_seq + 1
        if self.device.type == "cpu":
            budget = int(float(os.environ.get("KERNEL_LAB_CPU_KV_CACHE_GB", 0)) * (1 << 30)) \
                or DEFAULT_CPU_KV_CACHE_BYTES
            return max(self.blocks_per_seq, min(useful, budget // per_block))
        activation_peak = self._profile_activations(model)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * self.gpu_memory_utilization) - (total - free) - activation_peak \
            - GRAPH_MEMORY_RESERVE_BYTES
        if budget < per_block * self.blocks_per_seq:
            raise ValueError(f"not enough GPU memory for the KV cache of one {self.max_model_len}-token sequence "
                             f"(budget {budget / 2**30:.2f} GiB); raise gpu_memory_utilization or lower max_model_len")
        return min(useful, budget // per_block)

    @torch.inference_mode()
    def _profile_activations(self, model) -> int:
        """Peak extra memory of the largest eager step: one prefill chunk of max_num_batched_tokens."""
        from kernel_lab.models.attention import AttentionMetadata, LayerKVCache, PrefillChunk

        c, num_tokens = self.model_config, self.max_num_batched_tokens
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        dummy = torch.empty((1, self.block_size, c.num_kv_heads, c.head_dim), dtype=self.dtype, device=self.device)
        caches = [LayerKVCache(dummy, dummy)] * c.num_layers
        slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device)  # write nothing
        meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillChunk(0, num_tokens, 0)])
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.max_model_len
        model.compute_logits(model(ids, positions, caches, meta)[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        return peak


def _model_name(model, model_dir: Path | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    if isinstance(model, dict):
        return f"random-{model.get('model_type', 'model')}"
    path = Path(model)
    return path.stem if path.suffix.lower() == ".gguf" else path.name
