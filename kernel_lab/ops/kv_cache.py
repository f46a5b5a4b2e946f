"""Paged KV cache: allocation, `write_kv`, and the scales of FP8 E4M3 and int8 pages (projects 04, 05; issue 35).

Contract (shared with the engine)
---------------------------------
- `k_cache`, `v_cache`: `[num_blocks, block_size, num_kv_heads, head_dim]`, block_size in {8, 16, 32, 64},
  head_dim in SUPPORTED_HEAD_DIMS {64, 96, 128, 256} on CUDA (the CUDA kernels' instantiations; 96 is
  Phi-3's), any head_dim on the CPU (the C kernel and the references are generic in it). The inner three
  dimensions are dense (strides `(H*D, D, 1)`); the block stride may be larger (e.g. views of one
  `[num_blocks, 2, block_size, H, D]` allocation). Dtype fp16, bf16, fp32, `torch.float8_e4m3fn`, or
  `torch.int8` (CPU only: no CUDA kernel reads int8 pages).
- FP8 and int8 caches (SCALED_DTYPES) carry `k_scale`, `v_scale`, float32 and contiguous (`scale_shape`):
  fp8 `[num_blocks, num_kv_heads]`, one scale per page and KV head (shared with the CUDA kernels); int8
  `[num_blocks, block_size, num_kv_heads, ceil(head_dim / 16)]`, one scale per token, KV head and group of
  INT8_GROUP = 16 channels (the last group shorter when 16 does not divide head_dim). A stored element means
  `float(fp8) * scale`, or for int8 `code * scale` with codes in [-127, 127] and -128 meaning NaN. A fresh
  cache has every scale at 0.0: the page holds no data yet.
- `write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None)`: key/value
  `[tokens, num_kv_heads, head_dim]` in the cache's dtype (any float dtype for fp8; float32 also into
  fp16/bf16 CPU pages, rounded to nearest even); `slot_mapping` int64 `[tokens]` = `block * block_size +
  offset`; a slot of -1 is skipped. Two tokens of one call writing the same slot leave either one (unspecified).

int8 write (issue 35; llama.cpp's q8_0 idea): each token's row of each KV head is quantised once, each group of
16 channels with its own scale `s = amax / 127` over the group's finite elements (one float32 division, at least
2**-126; 0 for a group without any) and codes `round(x / s)`, nearest even: `|x - code * s| <= s / 2` (up to
float32's rounding of the division and the product), whatever was written before or after. Nothing is
requantised, so one row (a later token, a rejected speculative draft) never moves another's codes. Why not per
page: on SmolLM2 a page's scale follows its largest row, and the first (attention-sink) token, whose V rows are
a third of their page's, kept a few bits and took most of the attention weight (projects/09_engine/README.md).
The scales cost 2 * 4 * ceil(head_dim / 16) bytes per token and KV head against 2 * head_dim code bytes (25%).
int8 K and V rows are stored rotated: `H k`, `H v`, with H Sylvester's unnormalised Hadamard matrix (entries
+-1) on blocks of `hadamard_block(head_dim)` channels (the whole row for a power-of-two head_dim), formed in
float32 before the scale (`hadamard_rotate`). A reader rotates the query the same way and divides by the block,
since `(H q) . (H k) = block * (q . k)`, and rotates its output back once, since `sum p H v = H (sum p v)`;
`int8_rows` undoes it for a reader of the rows themselves. Why: K has outlier channels (a few channels of RoPE'd
keys carry most of a row's magnitude), so a row's scale follows them and the other channels keep a few levels; H
spreads every channel over all of them (QuaRot's observation), and the bound `|H k - code * s| <= s / 2` per
element becomes, after the inverse, a bound on k's elements of half the mean scale of their Hadamard block's
groups, with scales that no longer follow one channel. Why a scale per 16 channels and not per row: after the
rotation a row's magnitude still varies along it (the study behind the choice: docs/kv_page_formats.md). The
rotation is what first raised int8's greedy agreement with float32 pages (projects/09_engine/README.md). V's rows
have milder outliers, and rotating them too raised the agreement again (same page). A non-finite element of a
row spreads over its block (NaN where +inf meets -inf), where unrotated it stayed in its channel: the row's
scores, or the output, were NaN or inf either way.

fp8 write policy (project 05's, as the CUDA kernels write it): every page scale `write_kv` writes is the
smallest power of two >= amax / 448 (at least 2**-126) over everything the page and head has received; a page
whose scale grows is requantised once. In any write order fp8 holds
`|x - dequant(quant(x))| <= 2**-4 * |x| + scale * 2**-9`. The policy step by step and why the bound holds:
projects/05_fp8_kv/README.md.
Pages whose scale was set outside `write_kv` to a non-power-of-two keep working (the scale never shrinks),
but the bound is only guaranteed for scales `write_kv` manages.
Non-finite inputs (both paths alike, tested): NaN and +-inf take no part in a scale (amax is over the finite
elements only, so one bad token cannot blow up or zero a page's scale); a NaN is stored as NaN (int8: the
code -128) and an fp8 NaN stays NaN through requantisation; +-inf saturates to +-448 * scale (int8: +-127 *
scale), like E4M3's SATFINITE conversion.

Dispatch: CPU tensors always take the PyTorch reference below (with validation); CUDA tensors run the
CUDA C++ kernels of `kernel_lab/csrc/kv_cache.cu` (fp16/bf16/fp32 input; any cache dtype of the contract but
int8). The engine's fused CPU decode call writes int8 and fp8 pages itself (csrc/cpu/kv_int8.h), one token after
another: this reference called once per token, bit for bit.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .common import FLOAT_DTYPES, check_same_device, check_tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
INT8_NAN = -128  # the int8 code outside the symmetric range: a stored NaN
MIN_FP8_SCALE = 2.0 ** -126  # smallest normal fp32: keeps `fp8 * scale` exact
SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64)
SUPPORTED_HEAD_DIMS = (64, 96, 128, 256)  # the CUDA kernels' head_dim instantiations; the CPU paths take any
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8_DTYPE, torch.int8)
# Page formats with float32 scales (fp8: per page and KV head; int8: per token and KV head), and the largest
# magnitude of each one's codes.
SCALED_DTYPES = (FP8_DTYPE, torch.int8)
CODE_MAX = {FP8_DTYPE: FP8_MAX, torch.int8: INT8_MAX}


# Channels per int8 scale: a row of head_dim channels has int8_groups(head_dim) scales (the last group shorter
# when 16 does not divide head_dim). The group, not the row, is what the greedy-agreement study settled on.
INT8_GROUP = 16


def int8_groups(head_dim: int) -> int:
    return -(-head_dim // INT8_GROUP)


def scale_shape(dtype: torch.dtype, num_blocks: int, block_size: int, num_kv_heads: int,
                head_dim: int) -> tuple[int, ...]:
    """The shape of a scaled cache's `k_scale`/`v_scale`: fp8 one per (page, KV head), int8 one per (token, KV
    head, group of INT8_GROUP channels)."""
    if dtype == torch.int8:
        return (num_blocks, block_size, num_kv_heads, int8_groups(head_dim))
    return (num_blocks, num_kv_heads)


def expand_int8_scales(scale: torch.Tensor, head_dim: int) -> torch.Tensor:
    """int8 scales `[..., groups]` as one per channel `[..., head_dim]`."""
    return scale.repeat_interleave(INT8_GROUP, dim=-1)[..., :head_dim]


def element_scales(scale: torch.Tensor, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
    """`scale` viewed to broadcast against pages `[blocks, block_size, num_kv_heads, head_dim]` (or the same
    blocks of them: `scale[blocks]`)."""
    return expand_int8_scales(scale, head_dim) if dtype == torch.int8 else scale[:, None, :, None]


# --------------------------------------------------------------------------------------------- allocation
def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device | str = "cpu"):
    """A zeroed paged cache: returns (k_cache, v_cache, k_scale, v_scale); scales are None unless fp8 or
    int8, where they are float32 zeros of `scale_shape` (every page empty)."""
    if dtype not in CACHE_DTYPES:
        raise TypeError(f"dtype must be one of {CACHE_DTYPES}, got {dtype}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {block_size}")
    check_head_dim("head_dim", head_dim, torch.device(device))
    if num_blocks < 1 or num_kv_heads < 1:
        raise ValueError(f"num_blocks and num_kv_heads must be >= 1, got {num_blocks}, {num_kv_heads}")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=dtype, device=device)
    v_cache = torch.zeros(shape, dtype=dtype, device=device)
    if dtype not in SCALED_DTYPES:
        return k_cache, v_cache, None, None
    k_scale = torch.zeros(scale_shape(dtype, num_blocks, block_size, num_kv_heads, head_dim), dtype=torch.float32,
                          device=device)
    v_scale = torch.zeros_like(k_scale)
    return k_cache, v_cache, k_scale, v_scale


def kv_cache_bytes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V (plus the two float32 scale tables for fp8 and int8) of a paged cache."""
    data = 2 * num_blocks * block_size * num_kv_heads * head_dim * dtype.itemsize
    if dtype not in SCALED_DTYPES:
        return data
    return data + 2 * 4 * math.prod(scale_shape(dtype, num_blocks, block_size, num_kv_heads, head_dim))


def write_kv_bytes_moved(tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                         cache_dtype: torch.dtype, pages: int = 0) -> int:
    """DRAM bytes one `write_kv` call must move at least: `tokens` rows written (slot >= 0) of key and
    value in `dtype` into a `cache_dtype` cache, landing on `pages` distinct pages (fp8 only).

    Each row of key and of value is read once and stored once (2 * tokens * num_kv_heads * head_dim
    elements each way) and its int64 slot read; an fp8 write also reads the K and V scale of every
    (page, KV head) it lands on (2 * pages * num_kv_heads float32) to quantise with. That is a write whose
    scales already cover its data (a decode step's append in the steady state). Not counted, as it depends
    on the data: a page whose scale grows is rewritten once (its block_size * head_dim bytes per KV head
    read and written, its new scale stored), and a slot of -1 costs its 8 slot bytes only. An int8 write
    stores each row's own K and V scales instead (2 * tokens * num_kv_heads * int8_groups(head_dim) float32) and
    `pages` is unused."""
    rows = 2 * tokens * num_kv_heads * head_dim
    scales = 0
    if cache_dtype in SCALED_DTYPES:
        scales = 2 * (tokens * int8_groups(head_dim) if cache_dtype == torch.int8 else pages) * num_kv_heads * 4
    return rows * (dtype.itemsize + cache_dtype.itemsize) + 8 * tokens + scales


# --------------------------------------------------------------------------------------------- scaled pages
def pow2_scale(amax: torch.Tensor, code_max: float = FP8_MAX) -> torch.Tensor:
    """The smallest power of two >= amax / code_max (float32, at least MIN_FP8_SCALE); 0 where amax is 0: fp8's
    page scale.

    Bit-identical to the CUDA kernel and csrc/cpu/kv_int8.h: `amax / code_max` rounds once (IEEE division),
    then the mantissa is rounded up to the next power of two."""
    ratio = amax.float() / code_max
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    scale = torch.ldexp(torch.ones_like(ratio), exponent).clamp_min(MIN_FP8_SCALE)
    return torch.where(amax > 0, scale, torch.zeros_like(scale))


def int8_token_scale(amax: torch.Tensor) -> torch.Tensor:
    """An int8 row's own scale: amax / 127 (float32, one IEEE division, at least MIN_FP8_SCALE); 0 where amax
    is 0. Bit-identical to csrc/cpu/kv_int8.h."""
    scale = (amax.float() / INT8_MAX).clamp_min(MIN_FP8_SCALE)
    return torch.where(amax > 0, scale, torch.zeros_like(scale))


def hadamard_block(head_dim: int) -> int:
    """Channels per block of int8 K's Hadamard rotation: the largest power of two dividing head_dim."""
    return head_dim & -head_dim


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """`H x` over the last dimension in float32, block by block (H Sylvester's unnormalised Hadamard matrix,
    `H H = block * I`): the butterfly passes of csrc/cpu/kv_int8.h in its order, so the same bits."""
    n = x.shape[-1]
    block = hadamard_block(n)
    y = x.float().reshape(*x.shape[:-1], n // block, block)
    h = 1
    while h < block:
        pairs = y.view(*y.shape[:-1], block // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).view(*y.shape)
        h *= 2
    return y.reshape(x.shape)


def int8_rows(rotated: torch.Tensor) -> torch.Tensor:
    """K or V rows from int8 pages' dequantised values (`H x`): `H (H x) / block`."""
    return hadamard_rotate(rotated) * (1.0 / hadamard_block(rotated.shape[-1]))


def finite_amax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """max |x| over the finite elements (0 where there are none): NaN and inf never set a scale."""
    magnitude = x.float().abs()
    return torch.where(torch.isfinite(magnitude), magnitude, torch.zeros_like(magnitude)).amax(dim=dim)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8(clamp(x / scale)) with round-to-nearest-even; `scale` broadcasts against x; scale 0 stores 0.
    NaN stays NaN (clamp propagates it) and +-inf saturates to +-448."""
    xf = x.float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (xf / safe).clamp(-FP8_MAX, FP8_MAX)
    q = torch.where((scale > 0) | torch.isnan(xf), q, torch.zeros_like(q))
    return q.to(FP8_DTYPE)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round(clamp(x / scale, +-127)) to nearest even as int8; `scale` broadcasts against x; scale 0 stores 0.
    NaN is stored as the code INT8_NAN (-128) and +-inf saturates to +-127."""
    xf = x.float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (xf / safe).clamp(-INT8_MAX, INT8_MAX).round()
    q = torch.where(scale > 0, q, torch.zeros_like(q))
    return torch.where(torch.isnan(xf), torch.full_like(q, INT8_NAN), q).to(torch.int8)


def page_codes(q: torch.Tensor) -> torch.Tensor:
    """The stored codes of fp8 or int8 pages as float32, before their scale (int8's -128 reads as NaN)."""
    codes = q.float()
    if q.dtype == torch.int8:
        codes = codes.masked_fill_(q == INT8_NAN, float("nan"))
    return codes


def dequantize_pages(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 or int8 pages' values: code * scale (`scale` broadcasts against q)."""
    return page_codes(q) * scale


def quantize_pages(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return quantize_int8(x, scale) if dtype == torch.int8 else quantize_fp8(x, scale)


# --------------------------------------------------------------------------------------------- validation
def check_head_dim(name: str, head_dim: int, device: torch.device) -> None:
    """CUDA: one of the kernels' instantiations; CPU: any positive head_dim."""
    if device.type == "cuda" and head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{name} must be one of {SUPPORTED_HEAD_DIMS} on CUDA (the paged attention and KV-write "
                         f"kernels are instantiated for those), got {head_dim}; the CPU paths take any head_dim")
    if head_dim < 1:
        raise ValueError(f"{name} must be >= 1, got {head_dim}")


def check_cache_pair(k_cache, v_cache, k_scale=None, v_scale=None) -> tuple[int, int, int, int]:
    """Validate a paged K/V cache pair (and fp8 scales); returns (num_blocks, block_size, heads, head_dim)."""
    check_tensor("k_cache", k_cache, dtypes=CACHE_DTYPES, ndim=4)
    if k_cache.dtype == torch.int8 and k_cache.is_cuda:
        raise TypeError("k_cache: int8 pages have no CUDA kernel (the CPU kernels read them); use "
                        "float8_e4m3fn pages on CUDA")
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), ndim=4)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, "
                         f"got {tuple(v_cache.shape)}")
    num_blocks, block_size, heads, head_dim = k_cache.shape
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"k_cache block_size (dim 1) must be one of {SUPPORTED_BLOCK_SIZES}, "
                         f"got {block_size}")
    check_head_dim("k_cache head_dim (dim 3)", head_dim, k_cache.device)
    if num_blocks < 1 or heads < 1:
        raise ValueError(f"k_cache must have at least one block and one head, "
                         f"got shape {tuple(k_cache.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride()[1:] != (heads * head_dim, head_dim, 1):
            raise ValueError(f"{name} must be dense in its last three dimensions (strides "
                             f"{(heads * head_dim, head_dim, 1)}), got strides {cache.stride()}")
    scaled = k_cache.dtype in SCALED_DTYPES
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not scaled:
            if s is not None:
                raise ValueError(f"{name} is only used with a float8_e4m3fn or int8 cache; "
                                 f"the cache is {k_cache.dtype}")
            continue
        if s is None:
            per_token = k_cache.dtype == torch.int8
            raise ValueError(f"{name} is required with a {k_cache.dtype} cache (float32 [num_blocks, "
                             f"{'block_size, num_kv_heads, groups' if per_token else 'num_kv_heads'}])")
        shape = scale_shape(k_cache.dtype, num_blocks, block_size, heads, head_dim)
        check_tensor(name, s, dtypes=(torch.float32,), ndim=len(shape))
        if tuple(s.shape) != shape:
            what = (f"token, KV head and {INT8_GROUP} channels" if k_cache.dtype == torch.int8
                    else "page and KV head")
            raise ValueError(f"{name} must have shape {shape} (one scale per {what}), got {tuple(s.shape)}")
        if not s.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {s.stride()}")
    return num_blocks, block_size, heads, head_dim


def _validate_write(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    num_blocks, block_size, heads, head_dim = check_cache_pair(k_cache, v_cache, k_scale, v_scale)
    input_dtypes = FLOAT_DTYPES if k_cache.dtype in SCALED_DTYPES else (k_cache.dtype,)
    if not k_cache.is_cuda and k_cache.dtype in (torch.float16, torch.bfloat16):
        input_dtypes = (torch.float32, k_cache.dtype)  # CPU float32 activations over 16-bit pages (rounded)
    check_tensor("key", key, dtypes=input_dtypes, ndim=3)
    check_tensor("value", value, dtypes=(key.dtype,), ndim=3)
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), ndim=1)
    tokens = slot_mapping.shape[0]
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != (tokens, heads, head_dim):
            raise ValueError(f"{name} must have shape {(tokens, heads, head_dim)} (tokens from slot_mapping, "
                             f"heads and head_dim from the cache), got {tuple(t.shape)}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
                      k_scale=k_scale, v_scale=v_scale)
    return num_blocks, block_size


def check_slot_values(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Host-side value check (reads device memory): every slot is -1 or inside the pool."""
    if slot_mapping.numel() == 0:
        return
    lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
    if lo < -1 or hi >= num_blocks * block_size:
        raise ValueError(f"slot_mapping values must be -1 (skip) or in [0, {num_blocks * block_size}) "
                         f"(num_blocks * block_size), got range [{lo}, {hi}]")


# --------------------------------------------------------------------------------------------- reference
def _write_scaled_reference(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor, blocks: torch.Tensor,
                            offsets: torch.Tensor) -> None:
    """Write one of K or V into fp8 pages under the page-scale policy, or into int8 pages with each row's own
    scale, rows rotated (module docstring); tokens already filtered to valid."""
    if cache.dtype == torch.int8:
        x = hadamard_rotate(x)
        head_dim, groups = x.shape[-1], scale.shape[-1]
        padded = F.pad(x, (0, groups * INT8_GROUP - head_dim))                  # zeros never raise an amax
        group_scale = int8_token_scale(finite_amax(padded.unflatten(-1, (groups, INT8_GROUP))))  # [tokens, heads, G]
        scale[blocks, offsets] = group_scale
        cache[blocks, offsets] = quantize_int8(x, expand_int8_scales(group_scale, head_dim))
        return
    heads = cache.shape[2]
    token_scale = pow2_scale(finite_amax(x), CODE_MAX[cache.dtype])             # [tokens, heads]
    new_scale = scale.clone()
    new_scale.scatter_reduce_(0, blocks[:, None].expand(-1, heads), token_scale, reduce="amax",
                              include_self=True)
    # Growth always lands on a power of two (a token's scale), even if the old scale was set elsewhere.
    grown_pages, grown_heads = torch.nonzero(new_scale > scale, as_tuple=True)
    if grown_pages.numel():
        old = scale[grown_pages, grown_heads]                                   # [n]
        ratio = torch.where(old > 0, old / new_scale[grown_pages, grown_heads], torch.zeros_like(old))
        stored = page_codes(cache[grown_pages, :, grown_heads])                 # [n, block_size, head_dim]
        # old == 0: the page held no data; zero-fill (stored bytes may be anything, even NaN patterns).
        requantised = torch.where(old[:, None, None] > 0, stored * ratio[:, None, None],
                                  torch.zeros_like(stored))
        unit = torch.ones((), device=cache.device)                              # the codes, requantised
        cache[grown_pages, :, grown_heads] = quantize_pages(requantised, unit, cache.dtype)
    scale.copy_(new_scale)
    cache[blocks, offsets] = quantize_pages(x, new_scale[blocks][:, :, None], cache.dtype)


def write_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    block_size = k_cache.shape[1]
    slots = slot_mapping
    if bool((slot_mapping < 0).any()):  # padding rows (slot -1) write nothing; a mask only when there are some
        valid = slot_mapping >= 0
        slots, key, value = slot_mapping[valid], key[valid], value[valid]
    if k_cache.dtype not in SCALED_DTYPES:
        for cache, rows in ((k_cache, key), (v_cache, value)):
            try:  # [num_blocks * block_size, heads, dim]: one row copy per slot, the engine's CPU hot path
                cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows.to(cache.dtype))
            except RuntimeError:  # a layout whose blocks and offsets do not merge into one dimension
                cache[slots // block_size, slots % block_size] = rows.to(cache.dtype)
        return
    blocks, offsets = slots // block_size, slots % block_size
    _write_scaled_reference(key, k_cache, k_scale, blocks, offsets)
    _write_scaled_reference(value, v_cache, v_scale, blocks, offsets)


# --------------------------------------------------------------------------------------------- public op
def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None, *, validate: bool | None = None) -> None:
    """Store key/value `[tokens, num_kv_heads, head_dim]` into the paged caches at `slot_mapping` (in place).

    FP8 and int8 caches quantise on write (fp8 under the page-scale policy, int8 with each row's own scale: this
    module's docstring) and update `k_scale`/`v_scale` in place. `validate` (default: on for CPU, off for CUDA)
    checks slot values on the host, which synchronises, so never set it inside a CUDA graph; a caller that
    checked the slots once per step (the engine) passes False."""
    num_blocks, block_size = _validate_write(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if validate or (validate is None and not key.is_cuda):
        if key.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("write_kv(validate=True) reads device memory and cannot run inside "
                               "CUDA graph capture")
        check_slot_values(slot_mapping, num_blocks, block_size)
    if slot_mapping.numel() == 0:
        return
    if not key.is_cuda:
        write_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    from .cuda_extension import load_extension

    load_extension().write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
