"""Attention over a flat batch of tokens from many sequences, with the paged KV cache of projects 04/05.

A step's batch is one flat list of tokens: first one token per decoding sequence, then the prefill chunks
(a run of prompt tokens per sequence, possibly after a cached prefix). Every token's K and V go into the
paged cache first (`write_kv`, at `slot_mapping`); then

- decode tokens run `paged_decode_attention` (project 04's kernel on CUDA, the C kernel on CPU), reading
  each sequence's whole context through its block table;
- each prefill chunk runs causal `scaled_dot_product_attention` over [cached prefix from the pages, then
  the chunk's own fresh K/V]. The prefix is read back from the cache (dequantised: fp8, int8); under a
  sliding window W only its last W - 1 positions, the oldest any of the chunk's queries sees, and the mask
  is transformers' (key kv visible to query q iff q - W < kv <= q). CUDA and CPU alike, any head_dim.

On CPU the model runner marks every token as a decode token (one query per row, its context length its
position + 1), so prompt tokens too go through the decode kernel and no row depends on the rest of the step
(engine/model_runner.py says why). Such a step (float32, the C kernels built) sets `fused_cpu_decode`, and
each layer makes one C call, `rope_write_paged_attention`, for what is otherwise RoPE, `write_kv` and the
attention call: the same arithmetic, without a hundred-odd microseconds of per-layer op dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernel_lab import ops
from kernel_lab.ops import cpu_kernels
from kernel_lab.ops.kv_cache import dequantize_pages, expand_int8_scales, int8_rows


@dataclass
class PrefillChunk:
    """Tokens [start, end) of the flat batch belong to one sequence whose first `num_cached` tokens are
    already in the cache; `prefix_slots` (device int64 [num_cached]) are their cache slots."""

    start: int
    end: int
    num_cached: int
    prefix_slots: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                    # int64 [num_tokens]; -1 = do not store (padding)
    num_decode_tokens: int = 0                    # the first rows of the batch, one per sequence
    decode_block_tables: torch.Tensor | None = None  # int32 [num_decode_tokens, max_blocks_per_seq]
    decode_seq_lens: torch.Tensor | None = None      # int32 [num_decode_tokens]; 0 = padding row
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Every row decodes, on CPU in float32 with the C kernels loaded, and the slots and tables were checked
    # for the step: layers may call rope_write_paged_attention and the unchecked norm and activation calls.
    fused_cpu_decode: bool = False


@dataclass
class LayerKVCache:
    k_cache: torch.Tensor                 # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    # fp8: float32 [num_blocks, num_kv_heads] (per page); int8: [num_blocks, block_size, num_kv_heads, groups]
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given cache slots as [len(slots), num_kv_heads, head_dim] in `dtype`."""
        block_size = self.k_cache.shape[1]
        k = self.k_cache.flatten(0, 1)[slots]
        v = self.v_cache.flatten(0, 1)[slots]
        if self.k_scale is not None and self.k_cache.dtype == torch.int8:  # a scale per token and 16 channels
            head_dim = k.shape[-1]
            k = int8_rows(dequantize_pages(k, expand_int8_scales(self.k_scale.flatten(0, 1)[slots], head_dim)))
            v = int8_rows(dequantize_pages(v, expand_int8_scales(self.v_scale.flatten(0, 1)[slots], head_dim)))
        elif self.k_scale is not None:  # fp8: a scale per page
            blocks = slots // block_size
            k = dequantize_pages(k, self.k_scale[blocks][..., None])
            v = dequantize_pages(v, self.v_scale[blocks][..., None])
        return k.to(dtype), v.to(dtype)


def _causal_prefill(q, k, v, num_cached: int, scale: float, window: int | None = None) -> torch.Tensor:
    """q [n, Hq, D] after `num_cached` keys, k/v [num_cached + n, Hkv, D] -> [n, Hq, D]; with a `window`
    each query sees its last `window` positions only (itself included), as the decode kernels do."""
    n, num_q_heads, _ = q.shape
    group = num_q_heads // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    # [1, H, len, D]: the 4-D form every SDPA backend (flash, memory-efficient, math) accepts
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if num_cached == 0 and not window:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        query_pos = torch.arange(num_cached, num_cached + n, device=q.device)
        key_pos = torch.arange(num_cached + n, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        if window:
            mask &= key_pos[None, :] > query_pos[:, None] - window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                    meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for the flat batch -> attention output [T, Hq, D], each token attending
    its last `window` positions when a sliding window is given."""
    # The model runner checked the slots and block tables once for the step; the layers do not repeat it.
    ops.write_kv(k, v, cache.k_cache, cache.v_cache, meta.slot_mapping, cache.k_scale, cache.v_scale,
                 validate=False)
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        ops.paged_decode_attention(q[:nd], cache.k_cache, cache.v_cache, meta.decode_block_tables,
                                   meta.decode_seq_lens, scale, cache.k_scale, cache.v_scale, out=out[:nd],
                                   validate=False, sliding_window=window)
    for chunk in meta.prefills:
        q_c, k_c, v_c = q[chunk.start:chunk.end], k[chunk.start:chunk.end], v[chunk.start:chunk.end]
        # the chunk's first query (at num_cached) sees back to num_cached - window + 1: older pages stay unread
        visible = min(chunk.num_cached, window - 1) if window else chunk.num_cached
        if visible:
            k_prefix, v_prefix = cache.gather(chunk.prefix_slots[chunk.num_cached - visible:], q.dtype)
            k_c, v_c = torch.cat([k_prefix, k_c]), torch.cat([v_prefix, v_c])
        # the mask depends on positions relative to the chunk only: the dropped prefix shifts both sides
        out[chunk.start:chunk.end] = _causal_prefill(q_c, k_c, v_c, visible, scale, window)
    return out


def rope_write_paged_attention(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: LayerKVCache,
                               meta: AttentionMetadata, scale: float, num_q_heads: int,
                               window: int | None = None) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) * D] (the qkv projection's output) and the step's cos/sin rows -> attention
    output [T, Hq * D], with RoPE applied to q and k and K, V stored in the cache, in one C call.

    Only for a step with `meta.fused_cpu_decode` (its conditions are the caller's promise; nothing is checked
    here, as in the other per-layer calls of a step)."""
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos, sin = rope
    out = torch.empty(qkv.shape[0], num_q_heads * cache.k_cache.shape[-1], dtype=qkv.dtype)
    cpu_kernels.rope_write_paged_attention_cpu(qkv, cos, sin, meta.slot_mapping, cache.k_cache, cache.v_cache,
                                               meta.decode_block_tables, meta.decode_seq_lens, num_q_heads, scale,
                                               out, window or 0, k_scale=cache.k_scale, v_scale=cache.v_scale)
    return out
