"""Project 06: the Triton building blocks that `topk` and `sample` (sampling.py) share: 64-bit rank keys,
the selection of a block's n largest keys, the candidate merge, and the two top-k kernels (per-tile
candidates, then the exact finish). The order and the design: sampling.py and projects/06_topk_sampling.
"""

from __future__ import annotations

import triton
import triton.language as tl

_ADD = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max
_MIN = tl.standard._elementwise_min
PAIRWISE_MAX = tl.constexpr(64)  # blocks up to this size select by pairwise ranking instead of bisection


@triton.jit
def _order_key(x):
    """fp32 -> int32 with the same signed order; -0.0 joins +0.0 and NaN ranks above +inf."""
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(key == -1, 0, key)
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit
def _key_to_float(key):
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_sampling_logits(row_ptr, cols, valid):
    """Logits as sample() sees them (NaN -> -inf, +inf -> largest finite) and their int32 order keys."""
    x = tl.load(row_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32)
    x = tl.minimum(tl.where(x != x, float("-inf"), x), 3.4028234663852886e38)
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return x, tl.where(key == -1, 0, key)


@triton.jit
def _select_top_n(hi, lo, valid, n, cap, BLOCK: tl.constexpr):
    """Mask of a prefix of the ranking of the valid (hi, lo) pairs that holds the n best and at most
    max(n, cap) elements (all valid ones when that is fewer).

    hi is the int32 logit key and lo = 2**31 - 1 - index >= 0, so the pairs are unique and "best" means
    larger logit, then lower index. Large blocks bisect on hi (at most 32 block-wide counts), stopping as
    soon as the count above the cut falls in [n, cap] (with cap >> n that takes a few rounds), and bisect on
    lo only when equal logits straddle the cut and would overflow cap. Blocks of at most PAIRWISE_MAX (64)
    keep exactly the n best, ranked by counting.
    """
    if BLOCK <= PAIRWISE_MAX:
        packed = (hi.to(tl.int64) << 32) | lo.to(tl.int64)
        better = valid[None, :] & (packed[None, :] > packed[:, None])
        rank = tl.reduce(better.to(tl.int32), 1, _ADD)
        keep = valid & (rank < n)
    else:
        cap = tl.maximum(cap, n)
        lo_b = tl.reduce(tl.where(valid, hi, 2147483647), 0, _MIN).to(tl.int64)
        hi_b = tl.reduce(tl.where(valid, hi, -2147483648), 0, _MAX).to(tl.int64)
        found = tl.reduce(valid.to(tl.int32), 0, _ADD) <= cap
        while (lo_b < hi_b) & (found == 0):  # invariant: count(hi >= lo_b) >= n > count(hi > hi_b)
            mid = lo_b + (hi_b - lo_b + 1) // 2
            count = tl.reduce((valid & (hi >= mid.to(tl.int32))).to(tl.int32), 0, _ADD)
            ok = count >= n
            found = ok & (count <= cap)
            lo_b = tl.where(ok, mid, lo_b)
            hi_b = tl.where(ok, hi_b, mid - 1)
        cut = lo_b.to(tl.int32)
        above = valid & (hi > cut)
        tie = valid & (hi == cut)
        need = n - tl.reduce(above.to(tl.int32), 0, _ADD)
        t_lo = tl.reduce(tl.where(tie, lo, 2147483647), 0, _MIN).to(tl.int64)
        t_hi = tl.reduce(tl.where(tie, lo, -1), 0, _MAX).to(tl.int64)
        fits = tl.reduce((above | tie).to(tl.int32), 0, _ADD) <= cap
        t_hi = tl.where(fits, t_lo, t_hi)  # every tie fits: keep them all
        while t_lo < t_hi:
            mid = t_lo + (t_hi - t_lo + 1) // 2
            ok = tl.reduce((tie & (lo >= mid.to(tl.int32))).to(tl.int32), 0, _ADD) >= need
            t_lo = tl.where(ok, mid, t_lo)
            t_hi = tl.where(ok, t_hi, mid - 1)
        keep = above | (tie & (lo >= t_lo.to(tl.int32)))
    return keep


@triton.jit
def _topk_tile_kernel(x_ptr, x_row_stride, V, k, cand_ptr, count_ptr, n_tiles,
                      TILE: tl.constexpr, SLOT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    cols = tile * TILE + tl.arange(0, TILE)
    valid = cols < V
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=valid, other=0.0).to(tl.float32)
    hi = _order_key(x)
    lo = 2147483647 - cols
    keep = _select_top_n(hi, lo, valid, k, SLOT, TILE)  # any superset up to SLOT: the finish ranks
    keep_i = keep.to(tl.int32)
    slot = row * n_tiles + tile
    pos = tl.associative_scan(keep_i, 0, _ADD) - 1
    tl.store(cand_ptr + slot * SLOT + pos, (hi.to(tl.int64) << 32) | lo.to(tl.int64), mask=keep)
    tl.store(count_ptr + slot, tl.reduce(keep_i, 0, _ADD))


@triton.jit
def _merge_kernel(in_cand_ptr, in_count_ptr, n_in, out_cand_ptr, out_count_ptr, n_out, k, k_ptr, exact,
                  PER_ROW_K: tl.constexpr, SLOT: tl.constexpr, GROUP: tl.constexpr):
    """Keep a superset (up to SLOT) of the best k of GROUP candidate slots, or exactly k when `exact`."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    j = tl.arange(0, GROUP * SLOT)
    slot = part * GROUP + j // SLOT
    pos = j % SLOT
    has_slot = slot < n_in
    count = tl.load(in_count_ptr + row * n_in + slot, mask=has_slot, other=0)
    valid = pos < count
    packed = tl.load(in_cand_ptr + (row * n_in + slot) * SLOT + pos, mask=valid, other=0)
    if PER_ROW_K:
        n = tl.minimum(tl.maximum(tl.load(k_ptr + row), 1), SLOT)
    else:
        n = k
    keep = _select_top_n((packed >> 32).to(tl.int32), (packed & 0x7FFFFFFF).to(tl.int32), valid, n,
                         tl.where(exact != 0, n, SLOT), GROUP * SLOT)
    keep_i = keep.to(tl.int32)
    out_slot = row * n_out + part
    out_pos = tl.associative_scan(keep_i, 0, _ADD) - 1
    tl.store(out_cand_ptr + out_slot * SLOT + out_pos, packed, mask=keep)
    tl.store(out_count_ptr + out_slot, tl.reduce(keep_i, 0, _ADD))


@triton.jit
def _topk_finish_kernel(cand_ptr, count_ptr, x_ptr, x_row_stride, values_ptr, indices_ptr, k,
                        KP: tl.constexpr, RANK_CHUNK: tl.constexpr):
    """Order a row's survivors (a prefix of its ranking, at least k long) by counting: an element's rank is
    the number of larger keys (keys are unique, so ranks are distinct), and ranks below k are stored straight
    to that position."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, KP)
    count = tl.load(count_ptr + row)
    valid = j < count
    row_cand = cand_ptr + row * KP
    packed = tl.load(row_cand + j, mask=valid, other=0)
    rank = tl.zeros([KP], dtype=tl.int32)
    for start in range(0, count, RANK_CHUNK):
        c = start + tl.arange(0, RANK_CHUNK)
        other = tl.load(row_cand + c, mask=c < count, other=-9223372036854775807 - 1)
        rank += tl.reduce((other[None, :] > packed[:, None]).to(tl.int32), 1, _ADD)
    index = 2147483647 - (packed & 0x7FFFFFFF).to(tl.int32)
    out = valid & (rank < k)
    values = tl.load(x_ptr + row * x_row_stride + index, mask=out)
    tl.store(values_ptr + row * k + rank, values, mask=out)
    tl.store(indices_ptr + row * k + rank, index.to(tl.int64), mask=out)
