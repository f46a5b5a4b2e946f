"""ModelConfig: the facts of a Hugging Face config.json the decoders need, parsed and checked once."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, config: dict) -> ModelConfig:
        from .loader import SUPPORTED_ARCHITECTURES

        arch = next((a for a in config.get("architectures") or [] if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported model architecture {config.get('architectures')!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = int(config["num_attention_heads"])
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.get('hidden_act')!r} (only silu)")
        window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
            sliding_window=int(window) if window else None,
        )

    @property
    def num_parameters(self) -> int:
        from .llama import checkpoint_shapes

        return sum(math.prod(shape) for shape in checkpoint_shapes(self).values())
