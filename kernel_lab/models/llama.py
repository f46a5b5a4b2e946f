"""Llama-family decoders (Llama 2/3, SmolLM2, Mistral, Qwen2) built on `kernel_lab.ops`.

    x = embed(ids)
    for each layer:  h = x + o_proj(attention(rope(q), rope(k), v))   with q|k|v = qkv_proj(rms_norm(x))
                     x = h + down_proj(silu_and_mul(gate_up_proj(rms_norm(h))))
    logits = lm_head(rms_norm(x))

The model works on a flat batch of tokens from many sequences (no padding): `positions` gives each token's
place in its sequence and `AttentionMetadata` says which tokens decode and which prefill (attention.py).
q, k, v and gate, up each have one stacked weight (vLLM's layout; `silu_and_mul` expects [gate | up]), so
each is one GEMM (`Linear`: cuBLAS on CUDA; MKL or oneDNN's blocked layout on CPU). A weight that arrives
as GGUF blocks (`QuantizedWeight`, the engine's weights="quantized" on CPU) is one more layout chosen at
load: `QuantizedLinear` computes on the blocks, and the embedding table (tied to lm_head in SmolLM2) is read
through them too.
Residual adds are fused into the next RMSNorm (`fused_add_rms_norm`), as in vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernel_lab import ops
from kernel_lab.ops.gguf_linear import PackedWeight, QuantizedWeight, dequantize_rows, gguf_linear, pack, stack

from .attention import AttentionMetadata, LayerKVCache, paged_attention, rope_write_paged_attention


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
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        per_layer = h * d * (self.num_heads * 2 + self.num_kv_heads * 2) + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h


# ------------------------------------------------------------------------------------------------ RoPE
def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotary frequencies, computed as transformers computes them (so fp32 results match)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(
            scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {scaling!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Neox-style ("rotate half") RoPE with a precomputed cos/sin table indexed by position."""

    def __init__(self, config: ModelConfig, max_positions: int, device):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * rope_inv_freq(config)[None, :]       # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)                           # [P, D]
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] of the batch's positions: looked up once per forward, used by every layer."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> a rotated copy (computed in fp32, returned in x's dtype)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


# ------------------------------------------------------------------------------------------------ layers
def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


# The row count oneDNN's blocked layout is chosen for. A/B runs of the model's projection shapes gave about the
# same speed for hints 2..32 at 2..512 rows; any hint >= 2 gives the blocked (not the row-major) layout.
BLOCKED_ROWS_HINT = 8


def _onednn_blocked_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` reordered once into oneDNN's blocked layout, or None where that path does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BLOCKED_ROWS_HINT)
    except (RuntimeError, AttributeError):  # a torch build without the op: F.linear everywhere
        return None


class Linear(nn.Module):
    """y = x @ weight.T (+ bias), weight [out, in] (it may stack several projections' rows).

    CUDA: F.linear. CPU, float32: a single row runs MKL's GEMV on the row-major weight; two or more rows run
    oneDNN on a copy of the weight reordered once, at load, into oneDNN's blocked layout (vLLM's CPU
    backend also prepacks with oneDNN). In A/B runs of the model's shapes on one core, the blocked copy was
    faster from 2 rows up and slower for a single row, whose GEMV only streams the weight once
    (projects/09_engine/README.md). The price is a second copy of each projection weight on CPU.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else _param(weight)
        self.bias = None if bias is None else _param(bias)
        self.blocked = _onednn_blocked_weight(self.weight)   # not a buffer: an opaque oneDNN tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked is None or x.shape[0] < 2:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.blocked, self.bias, "none", [], "")


class QuantizedLinear(nn.Module):
    """y = x @ W.T (+ bias) with W in GGUF blocks, packed once into the kernel's 8-row tiles
    (ops/gguf_linear.py). CPU, float32 activations."""

    def __init__(self, weight: QuantizedWeight | PackedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.packed = pack(weight) if isinstance(weight, QuantizedWeight) else weight
        self.bias = None if bias is None else _param(bias)

    @property
    def weight_bytes(self) -> int:
        return self.packed.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gguf_linear(x, self.packed, self.bias, validate=False)


class Embedding(nn.Module):
    """Rows of the token table: float32 (`table`), or GGUF blocks dequantized row by row (`packed`)."""

    def __init__(self, table: torch.Tensor | QuantizedWeight):
        super().__init__()
        if isinstance(table, QuantizedWeight):
            self.packed, self.table = pack(table), None
        else:
            self.packed, self.table = None, table if isinstance(table, nn.Parameter) else _param(table)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return F.embedding(ids, self.table)
        return dequantize_rows(self.packed, ids)


def linear_for(parts: list, bias: torch.Tensor | None = None) -> nn.Module:
    """One layer for the row-stacked `parts`: QuantizedLinear when all are GGUF blocks (of several formats: a
    PackedStack), else a float32 `Linear` (GGUF blocks mixed with float weights are dequantized)."""
    if all(isinstance(p, QuantizedWeight) for p in parts) and len({p.ggml_type for p in parts}) == 1:
        return QuantizedLinear(QuantizedWeight.cat(parts) if len(parts) > 1 else parts[0], bias)
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return QuantizedLinear(stack([pack(p) for p in parts]), bias)
    dense = [p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts]
    return Linear(torch.cat(dense) if len(dense) > 1 else dense[0], bias)


def weight_bytes(layer: nn.Module) -> int:
    """Bytes of weights a forward pass of `layer` reads."""
    if isinstance(layer, QuantizedLinear):
        return layer.weight_bytes
    return layer.weight.numel() * layer.weight.element_size()


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.config = config
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_sizes = [self.q_size, self.kv_size, self.kv_size]
        self.input_norm = _param(weights["input_layernorm.weight"])
        self.post_attention_norm = _param(weights["post_attention_layernorm.weight"])
        self.qkv_proj = linear_for([weights[f"self_attn.{p}_proj.weight"] for p in "qkv"],
                                   torch.cat([weights[f"self_attn.{p}_proj.bias"] for p in "qkv"])
                                   if config.qkv_bias else None)
        self.o_proj = linear_for([weights["self_attn.o_proj.weight"]])
        self.gate_up_proj = linear_for([weights[f"mlp.{p}_proj.weight"] for p in ("gate", "up")])
        self.down_proj = linear_for([weights["mlp.down_proj.weight"]])
        self.scale = config.head_dim ** -0.5

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden, residual, cache: LayerKVCache,
                meta: AttentionMetadata):
        eps = self.config.rms_norm_eps
        if residual is None:
            residual = hidden
            hidden = ops.rms_norm(hidden, self.input_norm, eps)
        else:
            hidden, residual = ops.fused_add_rms_norm(hidden, residual, self.input_norm, eps)
        qkv = self.qkv_proj(hidden)
        if meta.fused_cpu_decode:
            attn = rope_write_paged_attention(qkv, rope, cache, meta, self.scale, self.config.num_heads)
        else:
            q, k, v = qkv.split(self.qkv_sizes, dim=-1)
            tokens, d = hidden.shape[0], self.config.head_dim
            q, k = apply_rope(q.view(tokens, -1, d), *rope), apply_rope(k.view(tokens, -1, d), *rope)
            attn = paged_attention(q, k, v.reshape(tokens, -1, d), cache, meta, self.scale).view(tokens, -1)
        hidden = self.o_proj(attn)
        hidden, residual = ops.fused_add_rms_norm(hidden, residual, self.post_attention_norm, eps)
        hidden = self.down_proj(ops.silu_and_mul(self.gate_up_proj(hidden)))
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    """Llama / SmolLM2 / Mistral. Qwen2 differs only by the q/k/v bias (see Qwen2ForCausalLM)."""

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_positions: int):
        super().__init__()
        self.config = config
        missing = [n for n in expected_weight_names(config) if n not in state_dict]
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} weight(s) of a {config.architecture}, "
                             f"e.g. {missing[:3]}")

        def take(name):  # move one tensor at a time, so peak memory stays near one copy of the model
            value = state_dict.pop(name)
            if isinstance(value, QuantizedWeight):  # GGUF blocks: CPU, float32 activations (EngineConfig checks)
                return value
            return value.to(device=device, dtype=dtype)

        self.embed = Embedding(take("model.embed_tokens.weight"))
        self.layers = nn.ModuleList()
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            names = [n for n in list(state_dict) if n.startswith(prefix)]
            self.layers.append(DecoderLayer(config, {n[len(prefix):]: take(n) for n in names}))
        self.norm = _param(take("model.norm.weight"))
        if config.tie_word_embeddings or "lm_head.weight" not in state_dict:
            # tied: the same parameter (plus its blocked copy on CPU), or the same packed blocks
            self.lm_head = (Linear(self.embed.table) if self.embed.table is not None
                            else QuantizedLinear(self.embed.packed))
        else:
            self.lm_head = linear_for([take("lm_head.weight")])
        self.rotary = RotaryEmbedding(config, max_positions, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [T, hidden] (normalised) for the flat batch."""
        hidden = self.embed(input_ids)
        residual = None
        rope = self.rotary(positions)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, cache, meta)
        hidden, _ = ops.fused_add_rms_norm(hidden, residual, self.norm, self.config.rms_norm_eps)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every projection and the lm_head (embedding rows aside)."""
        layers = [self.lm_head] + [m for layer in self.layers for m in (layer.qkv_proj, layer.o_proj,
                                                                          layer.gate_up_proj, layer.down_proj)]
        return sum(weight_bytes(m) for m in layers)

    def resident_weight_bytes(self) -> int:
        """Bytes the weights occupy in memory, each storage counted once (a tied lm_head shares the
        embedding's): parameters, buffers and the quantized layers' packed tiles."""
        tensors = [*self.parameters(), *self.buffers()]
        tensors += [m.packed.tiles for m in self.modules() if getattr(m, "packed", None) is not None]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def expected_weight_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    parts = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
    for i in range(config.num_layers):
        names += [f"model.layers.{i}.{p}.weight" for p in parts]
        if config.qkv_bias:
            names += [f"model.layers.{i}.self_attn.{p}_proj.bias" for p in "qkv"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device,
                max_positions: int) -> LlamaForCausalLM:
    """The decoder for `config`, taking (and emptying) `state_dict`."""
    model = MODEL_CLASSES[config.architecture](config, state_dict, dtype, torch.device(device), max_positions)
    return model.eval()


def random_state_dict(config: ModelConfig, dtype=torch.float32, device="cpu", seed: int = 0):
    """Random weights for a config (benchmarks of real model shapes without a checkpoint), generated on
    `device`. Norm weights are 1 and projections are scaled by 1/sqrt(fan_in), so activations keep their
    scale through many layers."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    h, d = config.hidden_size, config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (config.num_heads * d, h),
            p + "self_attn.k_proj.weight": (config.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": (config.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, config.num_heads * d),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
        })
        if config.qkv_bias:
            for name, heads in (("q", config.num_heads), ("k", config.num_kv_heads), ("v", config.num_kv_heads)):
                shapes[p + f"self_attn.{name}_proj.bias"] = (heads * d,)
    state = {}
    for name, shape in shapes.items():
        scale = 1.0 if "embed" in name else (shape[-1] ** -0.5 if len(shape) == 2 else 0.02)
        t = torch.empty(shape, dtype=dtype, device=device)
        state[name] = t.normal_(0.0, scale, generator=g)
    ones = {"model.norm.weight"} | {f"model.layers.{i}.{n}.weight" for i in range(config.num_layers)
                                    for n in ("input_layernorm", "post_attention_layernorm")}
    for name in ones:
        state[name] = torch.ones(h, dtype=dtype, device=device)
    return state
