"""A fused CPU decode step's decoder layers as one C call (kernel_lab/csrc/cpu/decode_stack.c).

On a step whose every row decodes (`meta.fused_cpu_decode`) a Llama-shaped layer on GGUF weights is eight
C calls: two add+RMSNorms, four projections, SiLU-and-mul, and RoPE + KV write + attention. Made from
Python, with the module calls and wrappers between them, that glue was about a fifth of a batch-1 step on
the bundled model and does not split over threads (projects/09_engine/cpu_step_profile.py). Here the same
calls, in the same order on the same values, run from one C loop over the layers: outputs are
bit-identical to DecoderLayer.forward's, which stays the path for everything else.

It applies to a model whose layers are all the plain DecoderLayer with a SiLU DenseMLP, four unbiased
single-format quantized projections, no q/k norm, and one attention window; `plan` works that out once per
model. Per step (`for_step`) it also needs:
- LoRA rows (engine/lora.py, `LoRAManager.rows` set) only with float32 slots on CPU: the C loop then calls
  kl_lora_bgmv after each projection, as each LoRALinear calls add_lora in the layer loop (the same C kernel,
  so the same bits); a LoRA engine's base-model-only steps (map None) take the stack without it;
- every layer's KV cache in one KV_FORMATS format and shape (float32, float16, bfloat16 pages; int8 and
  fp8 pages with their per-layer k_scale and v_scale, passed to kl_rope_write_paged_attention as the layer
  loop passes them); any other mix of caches takes the layer loop.
KERNEL_LAB_DECODE_STACK=0 turns it off (the A/B and the per-layer profile use that).
"""

from __future__ import annotations

import ctypes
import os

import torch

from kernel_lab.ops import cpu_kernels
from kernel_lab.ops.gguf_linear import PackedWeight
from kernel_lab.ops.lora import LORA_WEIGHT_FORMATS

LAYER_FIELDS = 14   # as decode_stack.c, and its LoRA words:
LORA_HEADER, LORA_PROJECTION = 4, 8
LORA_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def enabled() -> bool:
    return os.environ.get("KERNEL_LAB_DECODE_STACK", "1") != "0"


class StackPlan:
    """What one call needs that is fixed for the model: per-layer pointers, sizes, the kernels' addresses."""

    def __init__(self, model, libs):
        config, layers = model.config, model.layers
        self.lib = libs["decode_stack"]
        first = layers[0]
        self.eps, self.scale, self.window = float(config.rms_norm_eps), float(first.scale), first.window or 0
        self.h = config.hidden_size
        self.qkv_n = _base(first.qkv_proj).packed.shape[0]
        self.q_heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.inter = _base(first.mlp.down_proj).packed.shape[1]
        self.fns = (ctypes.c_void_p * 5)(*(ctypes.cast(f, ctypes.c_void_p).value for f in (
            libs["gguf_linear"].kl_gguf_linear, libs["norm_activation"].kl_add_rms_norm_f32,
            libs["norm_activation"].kl_silu_and_mul_f32, libs["paged_decode_attention"].kl_rope_write_paged_attention,
            libs["lora"].kl_lora_bgmv)))
        self.weights = []
        for layer in layers:
            words = [layer.input_norm.data_ptr(), layer.post_attention_norm.data_ptr(), 0, 0, 0, 0]
            for proj in map(_base, (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)):
                words += [proj.packed.ggml_type, proj.packed.tiles.data_ptr()]
            self.weights.append(words)
        self.scratch_floats = 4 * self.h + self.qkv_n + self.q_heads * self.head_dim + 3 * self.inter
        self._caches_key = None
        self._layers = None
        self._cache_words = None
        self._lora = (None, None)

    def lora_words(self, manager):
        """decode_stack.c's LoRA words for the manager's slots (built once: the slot tensors never move), or
        None where the C loop cannot apply them (slots neither float32 nor bfloat16, or a projection it does not
        make)."""
        if self._lora[0] is manager:
            return self._lora[1]
        words = None
        stacks = [[manager.stacks.get((i, name)) for name in LORA_PROJECTIONS] for i in range(len(self.weights))]
        dtype = stacks[0][0][0].dtype if stacks and stacks[0][0] is not None else None
        if dtype in LORA_WEIGHT_FORMATS and all(
                ab is not None and ab[0].dtype == ab[1].dtype == dtype and ab[0].is_contiguous()
                for layer in stacks for ab in layer) and manager.scale.is_contiguous():
            header = [manager.scale.data_ptr(), manager.max_loras, manager.max_lora_rank, LORA_WEIGHT_FORMATS[dtype]]
            for name in LORA_PROJECTIONS:
                offsets = manager.projections[name].offsets
                header += [len(offsets) - 1, *offsets, *[0] * (4 - len(offsets)), *stacks[0][LORA_PROJECTIONS.index(
                    name)][1].stride()]
            per_layer = [t.data_ptr() for layer in stacks for ab in layer for t in ab]
            words = (ctypes.c_int64 * (len(header) + len(per_layer)))(*header, *per_layer)
        self._lora = (manager, words)
        return words

    def layer_words(self, kv_caches):
        """The per-layer words with this step's cache (and scale) pointers, or None where the caches do not
        share one KV_FORMATS format and shape (or int8/fp8 pages lack float32 scales): the layer loop then."""
        key = tuple((c.k_cache.data_ptr(), c.v_cache.data_ptr(), _ptr(c.k_scale), _ptr(c.v_scale)) for c in kv_caches)
        if key != self._caches_key:
            k0 = kv_caches[0].k_cache
            scaled = k0.dtype in cpu_kernels._SCALED_FORMATS
            words = []
            for w, c in zip(self.weights, kv_caches, strict=True):
                if k0.dtype not in cpu_kernels.KV_FORMATS or c.v_cache.dtype != k0.dtype \
                        or (c.k_cache.dtype, c.k_cache.shape, c.k_cache.stride()) != (k0.dtype, k0.shape, k0.stride()) \
                        or c.v_cache.stride() != k0.stride() \
                        or (scaled and not all(s is not None and s.dtype == torch.float32 and s.is_contiguous()
                                               for s in (c.k_scale, c.v_scale))):
                    return None
                w = list(w)
                w[2], w[3] = c.k_cache.data_ptr(), c.v_cache.data_ptr()
                if scaled:
                    w[4], w[5] = c.k_scale.data_ptr(), c.v_scale.data_ptr()
                words += w
            self._layers = (ctypes.c_int64 * len(words))(*words)
            self._cache_words = (ctypes.c_int64 * 4)(cpu_kernels.KV_FORMATS[k0.dtype], *k0.stride()[:3])
            self._sizes = (ctypes.c_int64 * 7)(self.h, self.qkv_n, self.q_heads, self.kv_heads, self.head_dim,
                                               self.inter, k0.shape[1])
            self._caches_key = key
        return self._layers


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _base(proj):
    """A projection's own weights: a LoRALinear's (engine/lora.py) base layer, else the projection."""
    return getattr(proj, "base_layer", proj)


def plan(model) -> StackPlan | None:
    """The model's StackPlan, or None where the stack does not apply (worked out once, kept on the model)."""
    cached = model.__dict__.get("_decode_stack_plan", False)
    if cached is not False:
        return cached
    result = None
    from .layers.linear import QuantizedLinear
    from .llama import DecoderLayer, DenseMLP, LlamaForCausalLM

    def plain(layer):
        projections = (layer.qkv_proj, layer.o_proj, *layer.mlp.projections()) \
            if isinstance(layer.mlp, DenseMLP) else ()
        return (type(layer) is DecoderLayer and type(layer.mlp) is DenseMLP and not layer.mlp.gelu
                and layer.q_norm is None and len(projections) == 4
                and all(type(p) is QuantizedLinear and isinstance(p.packed, PackedWeight) and p.bias is None
                        for p in map(_base, projections))
                and layer.input_norm.dtype == torch.float32 and layer.window == model.layers[0].window)

    if type(model).forward is LlamaForCausalLM.forward and len(model.layers) and all(map(plain, model.layers)):
        libs = {name: cpu_kernels.load_library(name)
                for name in ("decode_stack", "gguf_linear", "norm_activation", "paged_decode_attention", "lora")}
        if all(lib is not None for lib in libs.values()):
            result = StackPlan(model, libs)
    model.__dict__["_decode_stack_plan"] = result
    return result


def for_step(model, kv_caches, meta) -> StackPlan | None:
    """The plan if this step may take the stack (a fused CPU decode step, the stack on and applicable, LoRA
    rows only with slots it can apply, the caches as `layer_words` needs them), else None: the DecoderLayer
    loop."""
    if not meta.fused_cpu_decode or not enabled():
        return None
    stack = plan(model)
    lora = getattr(model, "lora_manager", None)
    if stack is None or (lora is not None and lora.rows is not None and stack.lora_words(lora) is None):
        return None
    return stack if stack.layer_words(kv_caches) is not None else None


def run(stack: StackPlan, rope, hidden: torch.Tensor, residual: torch.Tensor, normed_first: bool, kv_caches,
        meta, lora=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, residual) after every layer, as the DecoderLayer loop would leave them. `hidden` is layer 0's
    input, already normalised by its input norm when `normed_first` (`residual` then the embedding rows).
    `lora`: the model's LoRAManager, whose row map (int32, contiguous, if set) the C loop applies."""
    layers = stack.layer_words(kv_caches)
    rows, h = hidden.shape
    hidden, residual = hidden.contiguous(), residual.contiguous()
    cos, sin = rope
    scratch = torch.empty(rows * stack.scratch_floats, dtype=torch.float32)
    out = torch.empty(2, rows, h, dtype=torch.float32)
    tables = meta.decode_block_tables
    threads = cpu_kernels.step_threads()
    rows_map = None if lora is None else lora.rows
    lora_words = None if rows_map is None else stack.lora_words(lora)
    status = stack.lib.kl_decode_stack(
        layers, len(kv_caches), stack.fns, hidden.data_ptr(), residual.data_ptr(), int(normed_first), rows,
        stack._sizes, stack.eps, stack.scale, stack.window, cos.data_ptr(), sin.data_ptr(),
        meta.slot_mapping.data_ptr(), stack._cache_words, tables.data_ptr(), tables.stride(0),
        meta.decode_seq_lens.data_ptr(), threads, lora_words, None if rows_map is None else rows_map.data_ptr(),
        scratch.data_ptr(), out[0].data_ptr(), out[1].data_ptr())
    if status != 0:
        raise RuntimeError(f"kl_decode_stack failed with status {status}")
    return out[0], out[1]
