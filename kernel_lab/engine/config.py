"""EngineConfig: the engine's constructor arguments, validated, with device and dtypes resolved. Everything
that can be wrong with a configuration is found here, before any weight is loaded; it runs nothing and
probes no kernel (the weight path is picked by model_loader.py, the KV pool sized by the ModelRunner)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernel_lab.models.config import ModelConfig
from kernel_lab.models.loader import load_config, resolve_model_dir
from kernel_lab.ops.kv_cache import FP8_DTYPE, SUPPORTED_BLOCK_SIZES, kv_cache_bytes

from .block_manager import blocks_needed
from .generation_defaults import GENERATION_CONFIG_CHOICES, sampling_defaults
from .speculative_config import SpeculativeConfig

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
_KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
              "fp8": FP8_DTYPE, "fp8_e4m3": FP8_DTYPE}
# Formats named in issue 35 with no kernel on either device yet, refused by name rather than as unknown (none now).
_KV_DTYPES_WITHOUT_KERNEL = ()
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


def resolve_kv_cache_dtype(name: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The page dtype for `name` (already one of 'auto' and _KV_DTYPES), refused where no kernel reads it: on
    CPU the C kernel reads float32, float16, bfloat16, int8 and fp8 pages under float32 activations; on CUDA
    the kernel reads pages of the activation dtype or fp8 (int8 is refused)."""
    if name == "auto":
        # On CPU, float16 pages under float32 activations: the smallest format that meets issue 35's accuracy
        # bar (greedy agreement with float32 pages, projects/09_engine/README.md), half the bytes per token.
        return torch.float16 if device.type == "cpu" and dtype == torch.float32 else dtype
    resolved = _KV_DTYPES[name]
    if device.type == "cpu":
        if resolved != dtype and dtype != torch.float32:
            raise ValueError(f"kv_cache_dtype {name!r} under dtype {dtype}: the CPU kernel reads narrow pages "
                             "under float32 activations only; use dtype='float32' or kv_cache_dtype='auto'")
    elif resolved == torch.int8:
        raise ValueError(f"kv_cache_dtype {name!r} has no CUDA attention kernel (int8 pages are read on CPU); "
                         "use 'fp8' on CUDA")
    elif resolved != dtype and resolved != FP8_DTYPE:
        raise ValueError(f"kv_cache_dtype {name!r} under dtype {dtype}: the CUDA kernel reads pages of the "
                         "activation dtype or fp8; use 'auto' or 'fp8'")
    return resolved


def resolve_lora_dtype(name, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """LoRA slots' dtype (vLLM's --lora-dtype): auto is the activation dtype. Under float32 activations on CPU
    bfloat16 slots are read by csrc/cpu/lora.c too (half the bytes); any other mix has no kernel."""
    resolved = dtype if name in (None, "auto") else name if isinstance(name, torch.dtype) else _DTYPES.get(name)
    if resolved is None:
        raise ValueError(f"lora_dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {name!r}")
    if resolved != dtype and not (device.type == "cpu" and dtype == torch.float32 and resolved == torch.bfloat16):
        raise ValueError(f"lora_dtype {name!r} under {str(dtype).removeprefix('torch.')} activations on "
                         f"{device.type} has no LoRA kernel; use 'auto' (the activation dtype)"
                         f"{' or bfloat16' if device.type == 'cpu' and dtype == torch.float32 else ''}")
    return resolved


def _option(default, help_text: str, choices=None):
    """A field that is also a command-line flag (arg_utils.add_engine_arguments)."""
    return field(default=default, metadata={"help": help_text, "choices": choices})


@dataclass
class EngineConfig:
    """`model`: None (the bundled SmolLM2-135M-Instruct), a GGUF file or Hugging Face directory, or a
    config.json as a dict (random weights, token-id prompts only). After construction `device`, `dtype`,
    `kv_cache_dtype` and `lora_dtype` hold torch objects and `max_num_batched_tokens` a number. Two fields are filled in
    later, by the parts that can know them: `weights` by model_loader.load_model (the path taken) and
    `num_kv_blocks` by the ModelRunner (its default depends on the model's activations on CUDA).

    `weights`: "quantized" computes on a GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K blocks (CPU, float32
    activations, the C kernel of ops/gguf_linear.py); "float32" on dequantized float32 copies; "auto"
    (default) picks quantized wherever it applies, the faster path in projects/09_engine's measurements."""

    model: str | dict | None = _option(None, "Hugging Face directory or .gguf file (default: the bundled "
                                             "SmolLM2-135M-Instruct)")
    dtype: str | torch.dtype = _option("auto", "activation dtype: auto | float32 | bfloat16 | float16 (auto: float32 "
                                               "on CPU, the checkpoint's half type on CUDA)")
    max_model_len: int = _option(2048, "longest sequence, prompt and completion, in tokens")
    max_num_seqs: int = _option(64, "sequences running at once")
    max_num_batched_tokens: int | None = _option(None, "tokens per step (default: max(2048, max_num_seqs))")
    block_size: int = _option(16, "tokens per KV-cache block", choices=SUPPORTED_BLOCK_SIZES)
    kv_cache_dtype: str | torch.dtype = _option("auto", "KV-cache page dtype (auto: float16 on CPU under float32 "
                                                        "activations, else the activation dtype). CPU: "
                                                        "float32, float16, bfloat16, int8 or fp8 pages under float32 "
                                                        "activations; CUDA: the activation dtype or fp8",
                                                choices=("auto", *_KV_DTYPES, *_KV_DTYPES_WITHOUT_KERNEL))
    enable_prefix_caching: bool = _option(True, "share the KV blocks of common prompt prefixes")
    device: str | torch.device = _option("auto", "auto | cpu | cuda")
    num_kv_blocks: int | None = _option(None, "KV-cache blocks (default: what the memory budget holds)")
    gpu_memory_utilization: float = _option(0.9, "fraction of GPU memory the engine may use")
    enforce_eager: bool = _option(False, "no CUDA graphs")
    seed: int = _option(0, "seed of the engine's random stream (requests without a seed of their own)")
    pad_decode_batches: bool = _option(False, "pad decode batches to the CUDA-graph sizes even without graphs")
    weights: str = _option("auto", "CPU, GGUF models: compute on the GGUF's quantized blocks or on float32 copies "
                                   "(auto: quantized where the model and the CPU allow it)", choices=WEIGHT_CHOICES)
    generation_config: str = _option("auto", "request defaults: auto takes the model's generation_config.json "
                                             "sampling values where a request sets none; vllm ignores them",
                                     choices=GENERATION_CONFIG_CHOICES)
    enable_lora: bool = _option(False, "serve LoRA adapters (LLM.generate(..., lora_request=LoRARequest(...)))")
    max_loras: int = _option(1, "LoRA adapters resident at once (device slots; LRU eviction)")
    max_lora_rank: int = _option(16, "largest LoRA rank an adapter may have (slots are padded to it)")
    lora_dtype: str | torch.dtype = _option("auto", "LoRA slot dtype (auto: the activation dtype); bfloat16 under "
                                                    "float32 activations on CPU halves the adapters' bytes",
                                            choices=("auto", "float32", "bfloat16", "float16"))
    speculative_config: str | dict | None = _option(None, "speculative decoding, vLLM's JSON, e.g. "
                                                          "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                                                          "\"prompt_lookup_max\": 4}' (default: off)")
    model_dir: Path | None = field(init=False, default=None)
    hf_config: dict = field(init=False, repr=False, default_factory=dict)
    model_config: ModelConfig = field(init=False, repr=False, default=None)
    model_name: str = field(init=False, default="")
    sampling_defaults: dict = field(init=False, default_factory=dict)  # from generation_defaults.py

    def __post_init__(self):
        if isinstance(self.model, dict):
            self.hf_config = self.model
        else:
            self.model_dir = resolve_model_dir(self.model, float_weights=False)  # a GGUF's tensors are read in place
            self.hf_config = load_config(self.model_dir)
        self.model_config = config = ModelConfig.from_hf(self.hf_config)
        self.model_name = _model_name(self.model, self.model_dir)
        self.sampling_defaults = sampling_defaults(self.model_dir, self.generation_config)

        for name in ("max_model_len", "max_num_seqs", "max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"{config.max_position_embeddings}")
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {self.block_size!r}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(2048, self.max_num_seqs)
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens must be an integer >= max_num_seqs ({self.max_num_seqs}), "
                             f"got {self.max_num_batched_tokens!r}")
        if self.kv_cache_dtype in _KV_DTYPES_WITHOUT_KERNEL:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} has no attention kernel yet on any device")
        if self.kv_cache_dtype not in ("auto", *_KV_DTYPES):
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {tuple(_KV_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")

        if self.weights not in WEIGHT_CHOICES:
            raise ValueError(f"weights must be one of {WEIGHT_CHOICES}, got {self.weights!r}")

        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.device = resolve_device(self.device)
        self.dtype = resolve_dtype(self.dtype, self.device, self.hf_config)
        self.kv_cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, self.device, self.dtype)
        self.lora_dtype = resolve_lora_dtype(self.lora_dtype, self.device, self.dtype)
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int)
                                               or self.num_kv_blocks < self.blocks_per_seq):
            raise ValueError(f"num_kv_blocks ({self.num_kv_blocks}) must hold at least one sequence of "
                             f"max_model_len tokens: >= {self.blocks_per_seq} blocks of {self.block_size}")

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def blocks_per_seq(self) -> int:
        return blocks_needed(self.max_model_len, self.block_size)

    @property
    def use_cuda_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.enforce_eager

    def kv_bytes_per_block(self) -> int:
        c = self.model_config
        return c.num_layers * kv_cache_bytes(1, self.block_size, c.num_kv_heads, c.head_dim, self.kv_cache_dtype)


def _model_name(model, model_dir: Path | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    if isinstance(model, dict):
        return f"random-{model.get('model_type', 'model')}"
    path = Path(model)
    return path.stem if path.suffix.lower() == ".gguf" else path.name
