"""Project 04/05: paged decode attention over a block-table KV cache (fp16/bf16/fp32, FP8 E4M3 or int8 pages).

    out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b,   K_b/V_b = the first seq_lens[b] tokens of sequence b

Contract
--------
- `q`: `[batch, num_q_heads, head_dim]`, last dimension contiguous (batch/head strides are free, so a slice
  of a fused QKV output works). num_q_heads is a multiple of num_kv_heads (MHA, GQA, MQA): query head h
  reads KV head `h // (num_q_heads // num_kv_heads)`.
- `k_cache`, `v_cache`: `[num_blocks, block_size, num_kv_heads, head_dim]` (see `kv_cache.py`), the same
  dtype as q, float16 or bfloat16 pages under a float32 q on CPU, or `torch.float8_e4m3fn` (or, on CPU
  only, `torch.int8`) with float32 `k_scale`/`v_scale`: fp8's `[num_blocks, num_kv_heads]` (one per page),
  int8's `[num_blocks, block_size, num_kv_heads, groups]` (one per token and 16 channels;
  kv_cache.scale_shape). Stored value = `float(fp8) * scale`, or `code * scale` for int8, the code -128
  meaning NaN (kv_cache.py).
- `block_tables`: int32 `[batch, max_blocks_per_seq]`; token t of sequence b is at block
  `block_tables[b, t // block_size]`, offset `t % block_size`. Blocks may be anywhere, in any order, and
  shared. Entries past a sequence's last block are never read (padding such as -1 is fine).
- `seq_lens`: int32 `[batch]`, each in `[0, max_blocks_per_seq * block_size]`. A length of 0 yields a
  zero output row (padding rows of a captured CUDA graph).
- `scale` defaults to `head_dim ** -0.5`. The output has q's dtype and shape; `out=` may be given.
- `sliding_window` W (None or 0: none): the query, at position `seq_lens[b] - 1`, attends only the keys at
  positions `(seq_lens[b] - 1 - W, seq_lens[b] - 1]`, its last W tokens: transformers' sliding-window mask
  (`kv_idx > q_idx - W`, masking_utils) and llama.cpp's SWA (masked when `q - k >= W`). Table entries of
  pages wholly before the window are never read, and the CUDA kernel's split plan covers the window's
  pages only, so its work is bounded by W whatever the context length.
- `validate`: host-side value checks (seq_lens within the block table, used block ids inside the pool),
  raising ValueError. Default (None): on for CPU tensors, off for CUDA since it synchronises; refused
  during CUDA graph capture. A caller that checked the tables once per step (the engine, before its
  layers) passes False.

Dispatch: CPU float32 q with float32, float16, bfloat16, int8 or fp8 caches run the plain-C kernel
`kernel_lab/csrc/cpu/paged_decode_attention.c` (built on first use by `cpu_kernels.py`; it reads each page in
place, once, with an online softmax, widening narrow pages in registers, and trusts the table values, so
`validate=False` is for tables already checked). Other CPU inputs (fp16 or bf16 q), or any
without a C compiler or with `KERNEL_LAB_CPU_KERNELS=0`, run
`paged_decode_attention_reference` (materialising, float32 softmax). CUDA tensors run the CUDA C++ kernel
in `kernel_lab/csrc/paged_attention.cu`, which takes fp16/bf16 q with a cache of the same dtype or FP8 E4M3;
fp32 q is refused on CUDA.

The kernel (CTA per KV head group and split, flash-decoding split plan from shapes only):
projects/04_paged_decode/README.md; the bytes a call must move: `bytes_moved`. `kernel_model` below is the
same algorithm in PyTorch, used to test the kernel's maths without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .common import FLOAT_DTYPES, HALF_DTYPES, check_out, check_same_device, check_tensor
from .kv_cache import (
    FP8_DTYPE,
    SCALED_DTYPES,
    check_cache_pair,
    element_scales,
    hadamard_block,
    hadamard_rotate,
    int8_rows,
    page_codes,
)

# Kernel geometry, shared by the CUDA code (csrc/paged_attention.cu) and the CPU model; a compile test
# checks the two agree.
HEADS_PER_GROUP = 8        # query heads of one KV head served by one CTA (one K/V load)
ELEMS_PER_LANE = 8         # head_dim elements each lane owns: 16-byte loads for fp16/bf16, 8-byte for fp8
NUM_WARPS = 4
MIN_PARTITION_TOKENS = 256  # a split reads at least this many tokens, so its fixed cost stays small
CTAS_PER_SM_TARGET = 2      # split until the grid has about this many CTAs per SM
# The CUDA kernel's variants (PagedDecodeParams::variant): "direct" (default) loads each lane's K/V pieces
# into registers; "pipelined" copies each warp's next step into shared memory with 16-byte cp.async (16
# fp8 values per copy) in two stages and prefetches the next page index. Same maths, same bits.
DECODE_VARIANTS = {"direct": 0, "pipelined": 1}


# --------------------------------------------------------------------------------------------- reference
def paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale=None,
                                     k_scale=None, v_scale=None, sliding_window=None) -> torch.Tensor:
    """Materialising reference: gather each sequence's pages, then float32 attention (SDPA, masked).

    Also the CPU path of the engine, so it avoids per-token indexing: whole pages are gathered with one
    `index_select`, and the query heads of one KV head form the "query length" of a plain SDPA call.
    """
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else float(scale)
    lens = seq_lens.long()
    max_len = int(lens.max()) if batch else 0
    if max_len == 0:
        return torch.zeros_like(q)
    num_pages = -(-max_len // block_size)
    tokens = num_pages * block_size
    first = window_starts(lens, sliding_window)                                             # [B]
    # Table entries past a sequence's last page, or before its window's first, may be padding (e.g. -1):
    # read page 0 there instead.
    page_ids = torch.arange(num_pages, device=q.device)[None, :]
    used = (page_ids < (lens[:, None] + block_size - 1) // block_size) & (page_ids >= first[:, None] // block_size)
    pages = torch.where(used, block_tables[:, :num_pages].long(), 0).flatten()                 # [B * P]
    k = k_cache.index_select(0, pages)                                            # [B * P, bs, Hkv, D], a copy
    v = v_cache.index_select(0, pages)
    if k_cache.dtype in SCALED_DTYPES:
        k = page_codes(k).mul_(element_scales(k_scale[pages], k_cache.dtype, head_dim))
        v = page_codes(v).mul_(element_scales(v_scale[pages], k_cache.dtype, head_dim))
    k, v = k.float(), v.float()
    positions = torch.arange(tokens, device=q.device)[None, :]
    valid = (positions < lens[:, None]) & (positions >= first[:, None])                        # [B, T]
    # Slots past a sequence's length (or before its window) hold anything (stale, never written, even NaN).
    # Masking the score is not enough, since a zero probability times NaN is NaN: zero those rows of the copies.
    stale = (~valid).flatten().nonzero().squeeze(1)
    k = k.view(batch * tokens, num_kv_heads, head_dim).index_fill_(0, stale, 0.0)
    v = v.view(batch * tokens, num_kv_heads, head_dim).index_fill_(0, stale, 0.0)
    k = k.view(batch, tokens, num_kv_heads, head_dim).transpose(1, 2)                        # [B, Hkv, T, D]
    v = v.view(batch, tokens, num_kv_heads, head_dim).transpose(1, 2)
    qf = q.float()
    if k_cache.dtype == torch.int8:  # the pages hold H k: (H q / block) . (H k) = q . k (kv_cache's docstring)
        qf = hadamard_rotate(qf) * (1.0 / hadamard_block(head_dim))
    qg = qf.view(batch, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    if k_cache.dtype == torch.int8:  # V rows hold H v too: the output is H (sum p v)
        out = int8_rows(out)
    out = out.masked_fill((lens == 0)[:, None, None, None], 0.0)                  # length 0 -> a zero row
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


def window_starts(seq_lens: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """The first position each sequence's query attends (int64): len - W under a window W > 0, else 0."""
    lens = seq_lens.long()
    if not sliding_window:
        return torch.zeros_like(lens)
    return (lens - sliding_window).clamp_min(0)


# --------------------------------------------------------------------------------------------- split plan
@dataclass(frozen=True)
class SplitPlan:
    head_groups: int          # CTAs per KV head along the query-head axis (ceil(group / HEADS_PER_GROUP))
    heads_per_group: int      # query heads each of those CTAs serves (<= HEADS_PER_GROUP)
    partition_blocks: int     # KV blocks per split
    num_splits: int           # splits per sequence (1: no merge kernel)


def plan_splits(batch: int, num_q_heads: int, num_kv_heads: int, max_blocks_per_seq: int, block_size: int,
                num_sms: int, sliding_window: int | None = None) -> SplitPlan:
    """How the kernel divides the work; depends on shapes (and the window) only, so it is fixed inside a
    CUDA graph. Under a window the splits cover the blocks a window can touch, counted from its first block."""
    group = num_q_heads // num_kv_heads
    head_groups = -(-group // HEADS_PER_GROUP)
    heads_per_group = -(-group // head_groups)
    ctas = batch * num_kv_heads * head_groups
    capacity_blocks = max(min(max_blocks_per_seq, window_blocks(sliding_window, block_size)), 1)
    wanted = -(-CTAS_PER_SM_TARGET * num_sms // max(ctas, 1))
    min_blocks = max(1, MIN_PARTITION_TOKENS // block_size)
    splits = max(1, min(wanted, capacity_blocks // min_blocks))
    partition_blocks = -(-capacity_blocks // splits)
    num_splits = -(-capacity_blocks // partition_blocks)
    return SplitPlan(head_groups, heads_per_group, partition_blocks, num_splits)


def window_blocks(sliding_window: int | None, block_size: int) -> int:
    """The most pages W consecutive positions can touch (a window that starts mid-page spills into one
    more); unbounded without a window."""
    if not sliding_window:
        return 1 << 62
    return -(-(sliding_window - 1) // block_size) + 1


def kernel_tile(heads_per_group: int) -> tuple[int, int]:
    """(head tile, chunk): the kernel instance's compile-time head count (a power of two >= heads_per_group)
    and how many tokens each lane group loads before it does any math."""
    tile = 1 << max(0, heads_per_group - 1).bit_length()
    return tile, (4 if tile <= 2 else 2)


def bytes_moved(seq_lens, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, cache_dtype: torch.dtype | None = None,
                sliding_window: int | None = None) -> int:
    """DRAM bytes one call must move at least, from its arguments: `seq_lens` the context lengths (one
    int per sequence), q/out in `dtype`, the cache in `cache_dtype` (default `dtype`; fp8 adds its scales).

    Per sequence of length L attending T = L tokens (min(L, W) under a window W) on its P pages (the
    table entries from the window's first page to the last, i.e. ceil(L / block_size) without a window):
    every attended K and V row once (2 * T * num_kv_heads * head_dim cache bytes: a CTA loads a row once
    for all the query heads of its group), the P table entries (int32), and for fp8 the K and V scales of
    those pages (2 * P * num_kv_heads float32). Once per call: q read and out written (batch * num_q_heads
    * head_dim elements each) and seq_lens (int32). Not counted, as they are not needed: a page shared by
    several sequences is counted once per sequence (these are lengths, not table contents); a group of
    more than HEADS_PER_GROUP query heads loads its rows once per head group (L2 serves the repeats); a
    split plan's float32 partials, written by the splits and read back by the merge kernel. GB/s are
    quoted against this count."""
    cache_dtype = cache_dtype or dtype
    row_bytes = num_kv_heads * head_dim * cache_dtype.itemsize
    page_bytes = 4 + (2 * num_kv_heads * 4 if cache_dtype in SCALED_DTYPES else 0)
    lens = [int(n) for n in seq_lens]
    total = 2 * len(lens) * num_q_heads * head_dim * dtype.itemsize + 4 * len(lens)
    for length in lens:
        first = max(0, length - sliding_window) if sliding_window else 0
        pages = -(-length // block_size) - first // block_size if length else 0
        total += 2 * (length - first) * row_bytes + pages * page_bytes
    return total


# --------------------------------------------------------------------------------------------- CPU model
def kernel_model(q, k_cache, v_cache, block_tables, seq_lens, scale=None, k_scale=None, v_scale=None,
                 num_sms: int = 132, plan: SplitPlan | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """The CUDA kernel's algorithm in PyTorch (float32), for testing its maths without a GPU.

    Same decomposition as the kernel: CTAs over (sequence, KV head, head group, split); inside a CTA, warp w
    takes the split's blocks w, w + NUM_WARPS, ...; inside a warp, `tokens_per_warp` lane groups each keep
    their own running (max, sum, accumulator) over the block offsets g, g + tokens_per_warp, ..., taken
    `chunk` tokens at a time with one online-softmax rescale per chunk. Scales: the logit multiplier is
    `scale * k_scale[page]`, and each probability is multiplied by `v_scale[page]` before it accumulates V.
    Lane groups then warps merge by max/rescale, and splits merge through (max, sum) = a log-sum-exp, as
    in the merge kernel. (The kernel works in base 2 with q pre-scaled by log2(e); the same maths.) A window
    starts the splits at its first block and the lane groups at its first offset in that block.
    """
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else float(scale)
    plan = plan or plan_splits(batch, num_q_heads, num_kv_heads, block_tables.shape[1], block_size, num_sms,
                               sliding_window)
    _, chunk = kernel_tile(plan.heads_per_group)
    # A lane group is head_dim / 8 lanes rounded up to a power of two (96: 12 lanes of data in 16).
    lanes_per_token = 1 << max(0, head_dim // ELEMS_PER_LANE - 1).bit_length()
    tokens_per_warp = max(1, 32 // lanes_per_token)
    is_fp8 = k_cache.dtype == FP8_DTYPE
    out = torch.zeros((batch, num_q_heads, head_dim), dtype=torch.float32)
    neg_inf = float("-inf")

    def merge(states):
        """(m, l, acc) triples over the same heads -> one, rescaling each to the common max."""
        m = torch.stack([s[0] for s in states]).amax(0)
        safe_m = torch.where(m == neg_inf, torch.zeros_like(m), m)
        l = sum(s[1] * torch.exp(s[0] - safe_m) for s in states)
        acc = sum(s[2] * torch.exp(s[0] - safe_m)[:, None] for s in states)
        return m, l, acc

    for b in range(batch):
        seq_len = int(seq_lens[b])
        window_first = max(0, seq_len - sliding_window) if sliding_window else 0
        for kvh in range(num_kv_heads):
            for hg in range(plan.head_groups):
                heads = [kvh * group + hg * plan.heads_per_group + i for i in range(plan.heads_per_group)]
                heads = [h for h in heads if h < (kvh + 1) * group]
                qf = q[b, heads].float()                                                   # [G, D]
                split_states = []
                for split in range(plan.num_splits):
                    first_block = window_first // block_size + split * plan.partition_blocks
                    last_block = min(first_block + plan.partition_blocks, -(-seq_len // block_size))
                    if first_block >= last_block:
                        continue  # the kernel's CTA writes (m=-inf, l=0); the merge ignores it
                    lane_states = []
                    for warp in range(NUM_WARPS):
                        for lane_group in range(tokens_per_warp):
                            m = torch.full((len(heads),), neg_inf)
                            l = torch.zeros(len(heads))
                            acc = torch.zeros(len(heads), head_dim)
                            for blk in range(first_block + warp, last_block, NUM_WARPS):
                                page = int(block_tables[b, blk])
                                k_mult = scale * (float(k_scale[page, kvh]) if is_fp8 else 1.0)
                                v_mult = float(v_scale[page, kvh]) if is_fp8 else 1.0
                                block_tokens = min(block_size, seq_len - blk * block_size)
                                first_offset = max(0, window_first - blk * block_size)
                                for base in range(first_offset, block_tokens, chunk * tokens_per_warp):
                                    offsets = [base + c * tokens_per_warp + lane_group for c in range(chunk)]
                                    offsets = [o for o in offsets if o < block_tokens]
                                    if not offsets:
                                        continue
                                    k = k_cache[page, offsets, kvh].float()                  # [C, D]
                                    v = v_cache[page, offsets, kvh].float()
                                    logits = (qf @ k.T) * k_mult                             # [G, C]
                                    m_new = torch.maximum(m, logits.amax(1))
                                    correction = torch.exp(m - m_new)
                                    p = torch.exp(logits - m_new[:, None])
                                    l = l * correction + p.sum(1)
                                    acc = acc * correction[:, None] + (p * v_mult) @ v
                                    m = m_new
                            lane_states.append((m, l, acc))
                    split_states.append(merge(lane_states))
                if not split_states:
                    continue  # seq_len 0: zero output
                m, l, acc = merge(split_states)
                out[b, heads] = acc / l[:, None]
    return out.to(q.dtype)


# --------------------------------------------------------------------------------------------- validation
def _validate(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, out, sliding_window=None):
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    num_blocks, block_size, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache, k_scale, v_scale)
    half_pages = not q.is_cuda and q.dtype == torch.float32 and k_cache.dtype in HALF_DTYPES
    if k_cache.dtype not in SCALED_DTYPES and k_cache.dtype != q.dtype and not half_pages:
        raise TypeError(f"k_cache must have q's dtype ({q.dtype}), float8_e4m3fn, int8 (CPU), or on CPU under a "
                        f"float32 q float16 or bfloat16, got {k_cache.dtype}")
    batch, num_q_heads, q_head_dim = q.shape
    if q_head_dim != head_dim:
        raise ValueError(f"q head_dim (dim 2) must match the cache's head_dim {head_dim}, "
                         f"got shape {tuple(q.shape)}")
    if q.stride(-1) != 1:
        raise ValueError(f"q must be contiguous in its last dimension, got strides {q.stride()}")
    if num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"q's num_q_heads ({num_q_heads}) must be a positive multiple of the cache's "
                         f"num_kv_heads ({num_kv_heads})")
    check_tensor("block_tables", block_tables, dtypes=(torch.int32,), ndim=2)
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have shape ({batch}, max_blocks_per_seq), "
                         f"got {tuple(block_tables.shape)}")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be contiguous in its last dimension, "
                         f"got strides {block_tables.stride()}")
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1)
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must have shape ({batch},), got {tuple(seq_lens.shape)}")
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous")
    if scale is not None and (not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale must be a positive finite float or None, got {scale!r}")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens,
                      k_scale=k_scale, v_scale=v_scale, out=out)
    check_out("out", out, tuple(q.shape), q.dtype, q.device)
    if out is not None and out.stride(-1) != 1:
        raise ValueError(f"out must be contiguous in its last dimension, got strides {out.stride()}")
    check_sliding_window(sliding_window)
    if q.is_cuda and q.dtype not in HALF_DTYPES:
        raise TypeError(f"the CUDA kernel takes q in float16 or bfloat16, got {q.dtype} "
                        "(the fp32 path is the CPU reference)")
    return num_blocks, block_size


def check_sliding_window(sliding_window) -> None:
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or not 0 <= sliding_window < 2**31):
        raise ValueError(f"sliding_window must be None or an int >= 0 (0: no window) and below 2**31, "
                         f"got {sliding_window!r}")


def check_table_values(block_tables, seq_lens, num_blocks: int, block_size: int,
                       sliding_window: int | None = None) -> None:
    """Host-side value checks (they read device memory): lengths fit the table, used block ids in the pool
    (a sliding window's pages only: those wholly before it are never read)."""
    if seq_lens.numel() == 0:
        return
    capacity = block_tables.shape[1] * block_size
    lens = seq_lens.long().cpu()
    if int(lens.min()) < 0 or int(lens.max()) > capacity:
        bad = int(torch.nonzero((lens < 0) | (lens > capacity))[0])
        raise ValueError(f"seq_lens[{bad}] = {int(lens[bad])} does not fit the block table: it must be in "
                         f"[0, {capacity}] (max_blocks_per_seq {block_tables.shape[1]} * "
                         f"block_size {block_size})")
    used_blocks = -(-lens // block_size)                                                # [B]
    entries = torch.arange(block_tables.shape[1])[None, :]
    used = (entries < used_blocks[:, None]) & (entries >= (window_starts(lens, sliding_window) // block_size)[:, None])
    ids = block_tables.cpu().long()
    out_of_pool = used & ((ids < 0) | (ids >= num_blocks))
    if bool(out_of_pool.any()):
        b, j = (int(x) for x in torch.nonzero(out_of_pool)[0])
        raise ValueError(f"block_tables[{b}, {j}] = {int(ids[b, j])} is outside the pool of {num_blocks} "
                         f"blocks (sequence {b} uses entries up to {int(used_blocks[b]) - 1})")


# --------------------------------------------------------------------------------------------- public op
def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           out: torch.Tensor | None = None, validate: bool | None = None,
                           sliding_window: int | None = None, variant: str = "direct") -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged KV cache (see module docstring).
    `variant` picks the CUDA kernel's variant (DECODE_VARIANTS); the CPU paths ignore it."""
    if variant not in DECODE_VARIANTS:
        raise ValueError(f"variant must be one of {tuple(DECODE_VARIANTS)}, got {variant!r}")
    num_blocks, block_size = _validate(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                                       out, sliding_window)
    if validate or (validate is None and not q.is_cuda):
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("paged_decode_attention(validate=True) reads device memory and cannot run "
                               "inside CUDA graph capture")
        check_table_values(block_tables, seq_lens, num_blocks, block_size, sliding_window)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not q.is_cuda:
        if q.dtype == torch.float32:
            from .cpu_kernels import paged_decode_attention_cpu

            result = out if out is not None else torch.empty(q.shape, dtype=q.dtype)
            if paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale, result,
                                          sliding_window or 0, k_scale=k_scale, v_scale=v_scale):
                return result
        result = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                  k_scale, v_scale, sliding_window)
        return out.copy_(result) if out is not None else result
    from .cuda_extension import launch_paged_decode

    result = out if out is not None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    launch_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, result,
                        sliding_window or 0, variant)
    return result
