"""ModelConfig: the facts of a Hugging Face config.json the decoders need, parsed and checked once.

The fields every family shares are read here; each architecture's file (registry.py names them) adds its own
(`translate_config`) and refuses what it does not implement."""

from __future__ import annotations

import math
from dataclasses import dataclass

ROPE_TYPES = ("default", "linear", "llama3")  # what layers/rotary.py computes
# Where each MoE checkpoint keeps a layer's experts: (prefix under the layer, expert j's gate, up and down names)
EXPERT_NAMES = {"MixtralForCausalLM": ("block_sparse_moe.", "w1", "w3", "w2"),
                "Qwen2MoeForCausalLM": ("mlp.", "gate_proj", "up_proj", "down_proj")}


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
    qk_norm: bool = False              # Qwen3: RMSNorm over each q and k head before RoPE
    hidden_act: str = "silu"           # "silu" (SwiGLU), "gelu_tanh" or "gelu" (Gemma's GeGLU)
    norm_offset: bool = False          # Gemma: norms scale by (1 + w); folded into w at load
    embed_scale: bool = False          # Gemma: embeddings times sqrt(hidden_size)
    fused_projections: bool = False    # Phi-3: the checkpoint stores qkv_proj and gate_up_proj stacked
    num_experts: int = 0               # Mixtral, Qwen-MoE: experts per layer (0: a dense MLP)
    experts_per_token: int = 0
    renormalize_experts: bool = True   # the top-k routing weights rescaled to sum to 1 (Qwen: norm_topk_prob)
    expert_intermediate_size: int = 0  # Qwen-MoE: each expert's (0: intermediate_size)
    shared_expert_intermediate_size: int = 0  # Qwen-MoE: an always-on expert, sigmoid-gated (0: none)

    @classmethod
    def from_hf(cls, config: dict) -> ModelConfig:
        from .registry import family_of

        arch, family = family_of(config)
        heads = int(config["num_attention_heads"])
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r} in {arch}'s config "
                             f"(supported: {', '.join(ROPE_TYPES)})")
        if float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError("unsupported partial_rotary_factor "
                             f"{rope.get('partial_rotary_factor', config.get('partial_rotary_factor'))!r} (only 1.0)")
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            if config.get(cap) is not None:
                raise ValueError(f"unsupported {cap}={config[cap]!r}: logit softcapping is not implemented")
        window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
        common = dict(
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
            qkv_bias=bool(config.get("attention_bias", False)),
            sliding_window=int(window) if window else None,
        )
        extra = family.translate_config(config)
        if "hidden_act" not in extra and config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.get('hidden_act')!r} for {arch} "
                             "(only silu)")
        common.update(extra)
        return cls(**common)

    @property
    def num_parameters(self) -> int:
        from .llama import checkpoint_shapes

        return sum(math.prod(shape) for shape in checkpoint_shapes(self).values())
