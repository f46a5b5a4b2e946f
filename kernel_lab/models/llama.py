"""The shared decoder of every family in registry.py (Llama, Mistral, Qwen2/3, Gemma, Phi-3, Mixtral, Qwen-MoE), on
`kernel_lab.ops` and `layers/`; each family's file sets the ModelConfig fields that switch its parts.

    x = embed(ids)
    for each layer:  h = x + o_proj(attention(rope(q), rope(k), v))   with q|k|v = qkv_proj(rms_norm(x))
                     x = h + mlp(rms_norm(h))
    logits = lm_head(rms_norm(x))

mlp is down_proj(silu_and_mul(gate_up_proj(.))) (gelu_and_mul for Gemma) or experts on ops.moe (Mixtral, Qwen-MoE);
Qwen3 normalises each q and k head before RoPE; Gemma scales the embeddings by sqrt(hidden); Mistral's
attention sees its last `sliding_window` positions.

The model works on a flat batch of tokens from many sequences (no padding): `positions` gives each token's
place in its sequence and `AttentionMetadata` says which tokens decode and which prefill (attention.py).
q, k, v and gate, up each have one stacked weight (vLLM's layout; `silu_and_mul` expects [gate | up]), so
each is one GEMM (`Linear`: cuBLAS on CUDA; MKL or oneDNN's blocked layout on CPU). A weight that arrives
as GGUF blocks (`QuantizedWeight`, the engine's weights="quantized" on CPU) is one more layout chosen at
load: `QuantizedLinear` computes on the blocks, and the embedding table (tied to lm_head in SmolLM2) is read
through them too.
Residual adds are fused into the next RMSNorm (`fused_add_rms_norm`), as in vLLM.

The checkpoint's tensor names and shapes are one table, `checkpoint_shapes`: loading checks a state dict
against it, random weights are drawn from it and the parameter count sums it. A Llama-shaped family is a
file with a subclass and its config translation, and an entry in registry.ARCHITECTURES.
"""

from __future__ import annotations

import torch
from torch import nn

from kernel_lab import ops
from kernel_lab.ops import cpu_kernels
from kernel_lab.ops.gguf_linear import QuantizedWeight

from . import decode_stack
from .attention import AttentionMetadata, LayerKVCache, paged_attention, rope_write_paged_attention
from .config import EXPERT_NAMES, ModelConfig
from .layers.linear import Embedding, Linear, QuantizedLinear, linear_for, param, weight_bytes
from .layers.rotary import RotaryEmbedding, apply_rope


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint for `config`, by its Hugging Face name, with its shape."""
    h, d, inter, vocab = config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    shapes = {"model.embed_tokens.weight": (vocab, h)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    shapes["model.norm.weight"] = (h,)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.o_proj.weight": (h, q)})
        if config.fused_projections:  # Phi-3: one stacked tensor each, as our layers hold them
            shapes[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
        else:
            shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                           p + "self_attn.v_proj.weight": (kv, h)})
        if config.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if config.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if config.num_experts:  # a router and per expert gate, up, down (Qwen-MoE: and a gated shared expert)
            prefix, gate, up, down = EXPERT_NAMES[config.architecture]
            moe, e_inter = p + prefix, config.expert_intermediate_size or inter
            shapes[moe + "gate.weight"] = (config.num_experts, h)
            for j in range(config.num_experts):
                shapes.update({f"{moe}experts.{j}.{gate}.weight": (e_inter, h),
                               f"{moe}experts.{j}.{up}.weight": (e_inter, h),
                               f"{moe}experts.{j}.{down}.weight": (h, e_inter)})
            if config.shared_expert_intermediate_size:
                shared = config.shared_expert_intermediate_size
                shapes.update({moe + "shared_expert.gate_proj.weight": (shared, h),
                               moe + "shared_expert.up_proj.weight": (shared, h),
                               moe + "shared_expert.down_proj.weight": (h, shared),
                               moe + "shared_expert_gate.weight": (1, h)})
        elif config.fused_projections:
            shapes.update({p + "mlp.gate_up_proj.weight": (2 * inter, h), p + "mlp.down_proj.weight": (h, inter)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                           p + "mlp.down_proj.weight": (h, inter)})
    return shapes


def expected_weight_names(config: ModelConfig) -> list[str]:
    return list(checkpoint_shapes(config))


def check_checkpoint(config: ModelConfig, state_dict: dict) -> None:
    """Every tensor the table names is there, with its shape (GGUF blocks carry theirs)."""
    shapes = checkpoint_shapes(config)
    missing = [n for n in shapes if n not in state_dict]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weight(s) of a {config.architecture}, "
                         f"e.g. {missing[:3]}")
    wrong = [(n, tuple(state_dict[n].shape), s) for n, s in shapes.items() if tuple(state_dict[n].shape) != s]
    if wrong:
        name, got, want = wrong[0]
        raise ValueError(f"{name} has shape {got}, expected {want} for this config ({len(wrong)} tensor(s) differ)")


class DenseMLP(nn.Module):
    """down_proj(act_and_mul(gate_up_proj(x))) with SiLU (SwiGLU) or tanh-GELU (Gemma's GeGLU)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.gate_up_proj = linear_for([weights["mlp.gate_up_proj.weight"]] if config.fused_projections
                                       else [weights[f"mlp.{p}_proj.weight"] for p in ("gate", "up")])
        self.down_proj = linear_for([weights["mlp.down_proj.weight"]])
        self.gelu = {"gelu_tanh": "tanh", "gelu": "none"}.get(config.hidden_act)

    def forward(self, x, fused_cpu_decode: bool = False):
        gate_up = self.gate_up_proj(x)
        if fused_cpu_decode and not self.gelu:
            return self.down_proj(cpu_kernels.silu_and_mul_decode(gate_up))
        return self.down_proj(ops.gelu_and_mul(gate_up, approximate=self.gelu) if self.gelu
                              else ops.silu_and_mul(gate_up))

    def projections(self):
        return [self.gate_up_proj, self.down_proj]


class MixtureOfExperts(nn.Module):
    """Mixtral's and Qwen-MoE's sparse MLP on project 07's `ops.moe`: softmax over the router's logits, the
    top-k experts (renormalised unless `renormalize_experts` is off, as in Qwen1.5-MoE), one grouped GEMM per
    projection over the tokens sorted by expert, then the weighted combine. The experts' gate and up are
    stacked into [E, 2I, H] at load, down into [E, H, I]. Qwen-MoE adds a shared expert, a dense MLP on every
    token scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        experts = range(config.num_experts)
        prefix, gate, up, down = EXPERT_NAMES[config.architecture]
        self.router = Linear(weights[prefix + "gate.weight"])
        self.w_gate_up = param(torch.stack([torch.cat([weights[f"{prefix}experts.{j}.{gate}.weight"],
                                                       weights[f"{prefix}experts.{j}.{up}.weight"]]) for j in experts]))
        self.w_down = param(torch.stack([weights[f"{prefix}experts.{j}.{down}.weight"] for j in experts]))
        self.top_k, self.renormalize = config.experts_per_token, config.renormalize_experts
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            shared = prefix + "shared_expert."
            self.shared_expert = DenseMLP(config, {f"mlp.{p}_proj.weight": weights[f"{shared}{p}_proj.weight"]
                                                   for p in ("gate", "up", "down")})
            self.shared_expert_gate = Linear(weights[prefix + "shared_expert_gate.weight"])

    def forward(self, x, fused_cpu_decode: bool = False):
        out = ops.moe(x, self.w_gate_up, self.w_down, self.router(x), self.top_k, renormalize=self.renormalize)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, fused_cpu_decode)
        return out

    def projections(self):
        # the routed experts a step reads depend on its routing: left out of decode_weight_bytes
        shared = [*self.shared_expert.projections(), self.shared_expert_gate] if self.shared_expert else []
        return [self.router, *shared]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], window: int | None):
        super().__init__()
        self.config = config
        self.window = window
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_sizes = [self.q_size, self.kv_size, self.kv_size]
        self.input_norm = param(weights["input_layernorm.weight"])
        self.post_attention_norm = param(weights["post_attention_layernorm.weight"])
        qkv = ([weights["self_attn.qkv_proj.weight"]] if config.fused_projections
               else [weights[f"self_attn.{p}_proj.weight"] for p in "qkv"])
        self.qkv_proj = linear_for(qkv, torch.cat([weights[f"self_attn.{p}_proj.bias"] for p in "qkv"])
                                   if config.qkv_bias else None)
        self.o_proj = linear_for([weights["self_attn.o_proj.weight"]])
        self.q_norm = param(weights["self_attn.q_norm.weight"]) if config.qk_norm else None
        self.k_norm = param(weights["self_attn.k_norm.weight"]) if config.qk_norm else None
        self.mlp = MixtureOfExperts(config, weights) if config.num_experts else DenseMLP(config, weights)
        self.scale = config.head_dim ** -0.5

    def normalize_qk(self, qkv: torch.Tensor) -> None:
        """Qwen3's per-head RMSNorm of q and k, written back into the qkv buffer: every attention path (the
        fused C decode call included) then reads normalised heads, and RoPE follows as in transformers."""
        tokens, d, eps = qkv.shape[0], self.config.head_dim, self.config.rms_norm_eps
        for start, size, weight in ((0, self.q_size, self.q_norm), (self.q_size, self.kv_size, self.k_norm)):
            heads = qkv[:, start:start + size]
            heads.copy_(ops.rms_norm(heads.reshape(-1, d), weight, eps).view(tokens, size))

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden, residual, cache: LayerKVCache,
                meta: AttentionMetadata):
        eps, fused = self.config.rms_norm_eps, meta.fused_cpu_decode
        add_rms_norm = cpu_kernels.add_rms_norm_decode if fused else ops.fused_add_rms_norm
        if residual is None:
            residual = hidden
            hidden = ops.rms_norm(hidden, self.input_norm, eps)
        else:
            hidden, residual = add_rms_norm(hidden, residual, self.input_norm, eps)
        qkv = self.qkv_proj(hidden)
        if self.q_norm is not None:
            self.normalize_qk(qkv)
        if meta.fused_cpu_decode:
            attn = rope_write_paged_attention(qkv, rope, cache, meta, self.scale, self.config.num_heads,
                                              self.window)
        else:
            q, k, v = qkv.split(self.qkv_sizes, dim=-1)
            tokens, d = hidden.shape[0], self.config.head_dim
            q, k = apply_rope(q.view(tokens, -1, d), *rope), apply_rope(k.view(tokens, -1, d), *rope)
            attn = paged_attention(q, k, v.reshape(tokens, -1, d), cache, meta, self.scale,
                                   self.window).view(tokens, -1)
        hidden = self.o_proj(attn)
        hidden, residual = add_rms_norm(hidden, residual, self.post_attention_norm, eps)
        return self.mlp(hidden, fused), residual


class LlamaForCausalLM(nn.Module):
    """Llama 2/3, SmolLM2; the other families (registry.py) subclass it with their config translation."""

    family_name = "Llama 2/3, SmolLM2"
    family_notes = "the shared decoder (llama3 and linear RoPE scaling)"
    family_test = "test_families.py::test_family_matches_transformers[llama3]"

    @classmethod
    def translate_config(cls, hf_config: dict) -> dict:
        """This family's ModelConfig fields beyond the shared ones (config.py), refusing what it lacks."""
        return {}

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_positions: int):
        super().__init__()
        self.config = config
        check_checkpoint(config, state_dict)

        def take(name):  # move one tensor at a time, so peak memory stays near one copy of the model
            value = state_dict.pop(name)
            if isinstance(value, QuantizedWeight):  # GGUF blocks: CPU, float32 activations (EngineConfig checks)
                return value
            if config.norm_offset and name.endswith("norm.weight"):  # Gemma: x * (1 + w), summed in float32
                value = value.float() + 1.0
            return value.to(device=device, dtype=dtype)

        self.embed = Embedding(take("model.embed_tokens.weight"))
        self.embed_scale = config.hidden_size ** 0.5 if config.embed_scale else None
        # a window at least the longest sequence never binds: left out, so no kernel does the window's arithmetic
        window = config.sliding_window if config.sliding_window and config.sliding_window < max_positions else None
        self.layers = nn.ModuleList()
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            names = [n for n in list(state_dict) if n.startswith(prefix)]
            self.layers.append(DecoderLayer(config, {n[len(prefix):]: take(n) for n in names}, window))
        self.norm = param(take("model.norm.weight"))
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
        if self.embed_scale is not None:  # rounded to the activations' dtype first, as transformers does
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        residual = None
        rope = self.rotary(positions)
        stack = decode_stack.for_step(self, kv_caches, meta)  # None: the layer loop
        if stack is not None and hidden.dtype == torch.float32:  # the layers as one C call, same bits
            first = self.layers[0]
            normed = ops.rms_norm(hidden, first.input_norm, self.config.rms_norm_eps)
            hidden, residual = decode_stack.run(stack, rope, normed, hidden, True, kv_caches, meta,
                                                getattr(self, "lora_manager", None))
        else:
            for layer, cache in zip(self.layers, kv_caches, strict=True):
                hidden, residual = layer(rope, hidden, residual, cache, meta)
        hidden, _ = ops.fused_add_rms_norm(hidden, residual, self.norm, self.config.rms_norm_eps)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every projection and the lm_head (embedding rows aside)."""
        layers = [self.lm_head] + [m for layer in self.layers
                                   for m in (layer.qkv_proj, layer.o_proj, *layer.mlp.projections())]
        return sum(weight_bytes(m) for m in layers)

    def resident_weight_bytes(self) -> int:
        """Bytes the weights occupy in memory, each storage counted once (a tied lm_head shares the
        embedding's): parameters, buffers and the quantized layers' packed tiles."""
        tensors = [*self.parameters(), *self.buffers()]
        tensors += [m.packed.tiles for m in self.modules() if getattr(m, "packed", None) is not None]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device,
                max_positions: int) -> LlamaForCausalLM:
    """The decoder for `config`, taking (and emptying) `state_dict`."""
    from .registry import model_class

    model = model_class(config.architecture)(config, state_dict, dtype, torch.device(device), max_positions)
    return model.eval()


def random_state_dict(config: ModelConfig, dtype=torch.float32, device="cpu", seed: int = 0):
    """Random weights for a config (benchmarks of real model shapes without a checkpoint), generated on
    `device`. Norm weights are 1 and projections are scaled by 1/sqrt(fan_in), so activations keep their
    scale through many layers."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, shape in checkpoint_shapes(config).items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape, dtype=dtype, device=device)
            continue
        scale = 1.0 if "embed" in name else (shape[-1] ** -0.5 if len(shape) == 2 else 0.02)
        state[name] = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, scale, generator=g)
    return state
