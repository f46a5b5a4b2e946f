"""Project 06: exact top-k and sampling from the renormalised top-k / top-p distribution.

Order. Every token of a row has a 64-bit rank key: the logit's order-preserving int32 image in the high
half (NaN above +inf, -0.0 equal to +0.0) and `2**31 - 1 - index` in the low half. Keys are unique, and
"larger key" means "larger logit, then lower index": ties are always broken towards the LOWEST INDEX, in
`topk` (the order of equal values) and in `sample` (which of equal logits a top-k / top-p cut keeps, and
greedy decoding).

The kernels of `topk` and `sample`, the exponential race, the exact rejection path for top-p, and the CPU
reference (same kept set, a different draw): projects/06_topk_sampling/README.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, check_same_device, check_tensor, use_triton
from .sampling_rules import RULES, satisfies
from .topk_kernels import (
    _ADD,
    _MAX,
    _MIN,
    _key_to_float,
    _load_sampling_logits,
    _merge_kernel,
    _order_key,
    _select_top_n,
    _topk_finish_kernel,
    _topk_tile_kernel,
)

MAX_VOCAB = 262144
MAX_K = 1024
MAX_TILE = 2048  # logits one stage-1 program examines (8 per thread at 8 warps: 16-byte bf16 loads)
MERGE_BLOCK = 4096  # candidates one merge program examines
SAMPLE_SLOT = 1024  # per-tile candidate capacity for sampling rows with a top_k (top_k above it: rejection path)
STREAM_CHUNK = 2048  # elements per step when one program streams a whole row
FLT_MAX = 3.4028234663852886e38

_INT_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------------------------- reference
def order_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys whose signed order is the order of the float32 values `x` (NaN above +inf, -0.0 == +0.0)."""
    bits = x.contiguous().view(torch.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = torch.where(key == -1, torch.zeros_like(key), key)
    return torch.where(torch.isnan(x), torch.full_like(key, 0x7FFFFFFF), key)


def rank_keys(x: torch.Tensor) -> torch.Tensor:
    """Unique int64 rank keys along the last dim: larger value first, then lower index."""
    idx = torch.arange(x.shape[-1], device=x.device, dtype=torch.int64)
    return (order_keys(x.float()).to(torch.int64) << 32) | (0x7FFFFFFF - idx)


def topk_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k with the documented tie rule (lowest index first among equal values)."""
    order = torch.topk(rank_keys(logits), k, dim=-1, sorted=True).indices
    return logits.gather(-1, order), order


def _sanitize(x: torch.Tensor) -> torch.Tensor:
    """sample() treats NaN logits as -inf and +inf as the largest finite float."""
    return torch.nan_to_num(x.float(), nan=float("-inf"), posinf=FLT_MAX, neginf=float("-inf"))


def _splitmix64_uniform(seed: int) -> float:
    """A uniform in [0, 1) from a 64-bit seed (splitmix64 finaliser, top 53 bits)."""
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return (z >> 11) * (1.0 / (1 << 53))


def sample_reference(logits, temperature, top_k=None, top_p=None, seed=None) -> torch.Tensor:
    """The CPU path of `sample` (arguments validated, on the CPU). Rows are processed together, but only by
    operations that treat each row on its own (elementwise, cumulative sums along the row, top-k of unique
    keys), in float64, so a row's token never depends on the rest of the batch."""
    x = _sanitize(logits)
    rows_total, vocab = x.shape
    keys = order_keys(x)
    out = torch.argmax(keys, dim=1)  # greedy: the first index of the max
    row_max = x.max(dim=1).values
    temps = temperature.double()
    live = (temps > 0) & (row_max > float("-inf"))
    if not bool(live.any()):
        return out
    rows = torch.nonzero(live)[:, 0]
    if seed is not None:
        u = torch.tensor([_splitmix64_uniform(s) for s in seed[rows].tolist()], dtype=torch.float64)
    else:
        u = torch.rand(rows.numel(), dtype=torch.float64)
    e = torch.exp((x[rows].double() - row_max[rows, None].double()) / temps[rows, None])
    cdf = torch.cumsum(e, dim=1)  # index order; its last column is each row's normaliser Z
    ks = top_k[rows].long() if top_k is not None else torch.zeros_like(rows)
    ps = top_p[rows].double() if top_p is not None else torch.ones(rows.numel(), dtype=torch.float64)
    k_on = (ks > 0) & (ks < vocab)
    p_on = ps < 1.0
    plain = ~(k_on | p_on)
    if bool(plain.any()):  # inverse CDF in index order
        c = cdf[plain]
        pick = torch.searchsorted(c, (u[plain] * c[:, -1])[:, None], right=True)[:, 0]
        out[rows[plain]] = pick.clamp_max(vocab - 1)
    trunc = torch.nonzero(~plain)[:, 0]
    if trunc.numel():
        n_rank = torch.where(k_on[trunc], ks[trunc], vocab)
        n_cand = torch.where(k_on[trunc], n_rank, min(vocab, MAX_K))
        idx = torch.arange(vocab, dtype=torch.int64)
        packed = (keys[rows[trunc]].to(torch.int64) << 32) | (0x7FFFFFFF - idx)
        out[rows[trunc]] = _sample_ranked(packed, e[trunc], cdf[trunc, -1], n_rank, n_cand, ps[trunc],
                                          k_on[trunc], p_on[trunc], u[trunc])
    return out


def _sample_ranked(packed, e, total, n_rank, n_cand, p, k_on, p_on, u) -> torch.Tensor:
    """Inverse CDF over each row's kept prefix of the ranking (rows with top-k and/or top-p)."""
    vocab = packed.shape[1]
    order = torch.topk(packed, int(n_cand.max()), dim=1, sorted=True).indices
    e_sorted = e.gather(1, order)
    cum = torch.cumsum(e_sorted, dim=1)
    pos = torch.arange(order.shape[1])
    z_k = torch.where(k_on, cum.gather(1, (n_rank.clamp_max(order.shape[1]) - 1)[:, None])[:, 0], total)
    inside = ((cum - e_sorted) < (p * z_k)[:, None]) & (pos[None, :] < n_rank[:, None])
    n_keep = torch.where(p_on, inside.sum(dim=1).clamp_min(1), n_rank)
    # top-p alone: if every candidate was kept, the nucleus may reach past them; rank those rows fully
    more = p_on & ~k_on & (n_keep == n_cand) & (n_cand < vocab)
    if bool(more.any()):
        rows = torch.nonzero(more)[:, 0]
        result = torch.empty(packed.shape[0], dtype=torch.int64)
        result[rows] = _sample_ranked(packed[rows], e[rows], total[rows], n_rank[rows],
                                      torch.full_like(rows, vocab), p[rows], k_on[rows], p_on[rows], u[rows])
        rest = torch.nonzero(~more)[:, 0]
        if rest.numel():
            result[rest] = _sample_ranked(packed[rest], e[rest], total[rest], n_rank[rest], n_cand[rest], p[rest],
                                          k_on[rest], p_on[rest], u[rest])
        return result
    kept_mass = cum.gather(1, (n_keep - 1)[:, None])
    pick = torch.searchsorted(cum, u[:, None] * kept_mass, right=True)[:, 0]
    pick = torch.minimum(pick, n_keep - 1)  # u * mass can round up to the mass itself
    return order.gather(1, pick[:, None])[:, 0]


# --------------------------------------------------------------------------------------------- kernels
# Reductions call tl.reduce with the standard combine functions directly: identical code on the GPU, and
# under the interpreter they take its numpy fast path without the cost of a nested @jit call (tl.sum and
# friends are @jit wrappers, and every nested @jit call re-patches triton.language there).
@triton.jit
def _uniform_to_exponential(bits):
    """Random 32-bit words -> Exp(1) variates E = -log(u), u = (23 random bits + 0.5) / 2**23 strictly
    inside (0, 1), so 6e-8 <= E <= 16.7 and e / E is always finite."""
    u = ((bits.to(tl.uint32, bitcast=True) >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    return -tl.log(u)


@triton.jit
def _exponential_at(seed, index, round_id):
    """Race variates of the tokens `index` (any order) in rejection round `round_id`: Philox counter
    index // 4 (round in its high half), output word index % 4. Stage 1 derives the same words four at a
    time (`_exponential_tile`); a test pins the two together."""
    offset = (round_id.to(tl.int64) << 32) | (index >> 2).to(tl.int64)
    r0, r1, r2, r3 = tl.randint4x(seed, offset)
    lane = index & 3
    bits = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    return _uniform_to_exponential(bits)


@triton.jit
def _exponential_tile(seed, first, TILE: tl.constexpr):
    """Round-0 race variates of tokens first .. first + TILE - 1 (first % 4 == 0): one Philox call per
    four tokens."""
    quads = (first // 4 + tl.arange(0, TILE // 4)).to(tl.int64)
    r0, r1, r2, r3 = tl.randint4x(seed, quads)
    bits = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [TILE])
    return _uniform_to_exponential(bits)


@triton.jit
def _sample_tile_kernel(
    x_ptr, x_row_stride, V, temp_ptr, top_k_ptr, seed_ptr,
    tile_max_ptr, tile_sum_ptr, tile_score_ptr, tile_idx_ptr, cand_ptr, count_ptr, n_tiles,
    TILE: tl.constexpr, SLOT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    k = tl.load(top_k_ptr + row)
    sampling = temp > 0.0  # NaN or <= 0: greedy
    use_cand = sampling & (k > 0) & (k < V) & (k <= SLOT)
    cols = tile * TILE + tl.arange(0, TILE)
    valid = cols < V
    x, hi = _load_sampling_logits(x_ptr + row * x_row_stride, cols, valid)
    t_max = tl.reduce(x, 0, _MAX)
    slot = row * n_tiles + tile
    best_score = t_max
    best_idx = tl.reduce(tl.where(valid & (x == t_max), cols, 2147483647), 0, _MIN)
    t_sum = t_max * 0.0
    n_cand = best_idx * 0
    if use_cand:
        lo = 2147483647 - cols
        # A superset of up to SLOT is enough when merges follow; a single tile goes straight to the finish,
        # which needs exactly top_k.
        keep = _select_top_n(hi, lo, valid, k, tl.where(n_tiles == 1, k, SLOT), TILE)
        keep_i = keep.to(tl.int32)
        pos = tl.associative_scan(keep_i, 0, _ADD) - 1
        tl.store(cand_ptr + slot * SLOT + pos, (hi.to(tl.int64) << 32) | lo.to(tl.int64), mask=keep)
        n_cand = tl.reduce(keep_i, 0, _ADD)
    elif sampling:
        # Exponential race: token = argmax e_i / E_i with E_i ~ Exp(1) wins with probability e_i / sum(e).
        # e is taken relative to the tile max here; the finish rescales each tile's winner.
        e = tl.where(valid & (x > float("-inf")), tl.exp((x - t_max) / temp), 0.0)
        score = e / _exponential_tile(tl.load(seed_ptr + row), tile * TILE, TILE)
        best_score = tl.reduce(score, 0, _MAX)
        best_idx = tl.reduce(tl.where(valid & (score == best_score), cols, 2147483647), 0, _MIN)
        t_sum = tl.reduce(e, 0, _ADD)
    tl.store(tile_max_ptr + slot, t_max)
    tl.store(tile_sum_ptr + slot, t_sum)
    tl.store(tile_score_ptr + slot, best_score)
    tl.store(tile_idx_ptr + slot, best_idx)
    tl.store(count_ptr + slot, n_cand)


@triton.jit
def _top_k_mass(x_row, V, k, m, temp, CHUNK: tl.constexpr):
    """Sum of exp((x - m) / temp) over the k best-ranked tokens of a row, streaming it: bisection on the
    logit key for the k-th best, then one pass (equal logits have equal mass, so no index cut is needed)."""
    lo_b = tl.full([], -2147483648, tl.int64)
    hi_b = _order_key(m).to(tl.int64)
    while lo_b < hi_b:
        mid = lo_b + (hi_b - lo_b + 1) // 2
        acc = tl.zeros([CHUNK], dtype=tl.int32)
        for start in range(0, V, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            valid = cols < V
            x, hi = _load_sampling_logits(x_row, cols, valid)
            acc += (valid & (hi >= mid.to(tl.int32))).to(tl.int32)
        ok = tl.reduce(acc, 0, _ADD) >= k
        lo_b = tl.where(ok, mid, lo_b)
        hi_b = tl.where(ok, hi_b, mid - 1)
    cut = lo_b.to(tl.int32)
    n_above = tl.zeros([CHUNK], dtype=tl.int32)
    mass_above = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, V, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        valid = cols < V
        x, hi = _load_sampling_logits(x_row, cols, valid)
        above = valid & (hi > cut)
        n_above += above.to(tl.int32)
        mass_above += tl.where(above, tl.exp((x - m) / temp), 0.0)
    e_cut = tl.exp((_key_to_float(cut) - m) / temp)
    return tl.reduce(mass_above, 0, _ADD) + (k - tl.reduce(n_above, 0, _ADD)).to(tl.float32) * e_cut


@triton.jit
def _rejection_sample(x_row, V, m, temp, seed, rank_limit, mass_limit, first, CHUNK: tl.constexpr):
    """Exact draw from the tokens whose rank is < rank_limit and whose better-ranked mass is
    < mass_limit (the top-ranked token always qualifies), starting from the proposal `first`."""
    token = first
    round_id = first * 0
    done = first * 0
    while done == 0:
        x_j = tl.load(x_row + token).to(tl.float32)
        x_j = tl.minimum(tl.where(x_j != x_j, float("-inf"), x_j), 3.4028234663852886e38)
        hi_j = _order_key(x_j)
        lo_j = 2147483647 - token
        n_above = tl.zeros([CHUNK], dtype=tl.int32)
        mass_above = tl.zeros([CHUNK], dtype=tl.float32)
        for start in range(0, V, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            valid = cols < V
            x, hi = _load_sampling_logits(x_row, cols, valid)
            above = valid & ((hi > hi_j) | ((hi == hi_j) & ((2147483647 - cols) > lo_j)))
            n_above += above.to(tl.int32)
            mass_above += tl.where(above, tl.exp((x - m) / temp), 0.0)
        rank = tl.reduce(n_above, 0, _ADD)
        accept = (rank == 0) | ((rank < rank_limit) & (tl.reduce(mass_above, 0, _ADD) < mass_limit))
        if accept:
            done = done + 1
        else:
            # The kept set is a prefix of the ranking and `token` is outside it: draw again, with fresh
            # variates, from the tokens ranked above `token` (the kept set is still inside that domain).
            round_id = round_id + 1
            best_score = tl.full([], -1.0, tl.float32)
            best_idx = first * 0 + 2147483647
            for start in range(0, V, CHUNK):
                cols = start + tl.arange(0, CHUNK)
                valid = cols < V
                x, hi = _load_sampling_logits(x_row, cols, valid)
                above = valid & ((hi > hi_j) | ((hi == hi_j) & ((2147483647 - cols) > lo_j)))
                score = tl.where(above, tl.exp((x - m) / temp) / _exponential_at(seed, cols, round_id), -1.0)
                chunk_best = tl.reduce(score, 0, _MAX)
                chunk_idx = tl.reduce(tl.where(above & (score == chunk_best), cols, 2147483647), 0, _MIN)
                better = (chunk_best > best_score) | ((chunk_best == best_score) & (chunk_idx < best_idx))
                best_score = tl.where(better, chunk_best, best_score)
                best_idx = tl.where(better, chunk_idx, best_idx)
            token = best_idx
    return token


@triton.jit
def _sample_finish_kernel(
    x_ptr, x_row_stride, V, temp_ptr, top_k_ptr, top_p_ptr, seed_ptr,
    tile_max_ptr, tile_sum_ptr, tile_score_ptr, tile_idx_ptr, n_tiles, cand_ptr, count_ptr, out_ptr,
    TILES: tl.constexpr, SLOT: tl.constexpr, CHUNK: tl.constexpr, RANK_CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temp = tl.load(temp_ptr + row)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    seed = tl.load(seed_ptr + row)
    t = tl.arange(0, TILES)
    has_tile = t < n_tiles
    t_max = tl.load(tile_max_ptr + row * n_tiles + t, mask=has_tile, other=float("-inf"))
    t_idx = tl.load(tile_idx_ptr + row * n_tiles + t, mask=has_tile, other=2147483647)
    m = tl.reduce(t_max, 0, _MAX)
    # greedy, and rows that are -inf everywhere: the first index of the max
    token = tl.reduce(tl.where(has_tile & (t_max == m), t_idx, 2147483647), 0, _MIN)
    k_on = (k > 0) & (k < V)
    p_on = p < 1.0
    if (temp > 0.0) & (m > float("-inf")):
        if k_on & (k <= SLOT):
            j = tl.arange(0, SLOT)
            count = tl.load(count_ptr + row)
            valid = j < count
            row_cand = cand_ptr + row * SLOT
            packed = tl.load(row_cand + j, mask=valid, other=0)
            index = 2147483647 - (packed & 0x7FFFFFFF).to(tl.int32)
            e = tl.where(valid, tl.exp((_key_to_float((packed >> 32).to(tl.int32)) - m) / temp), 0.0)
            kept = valid
            if p_on:
                # For each candidate, the number and mass of better-ranked candidates (pairwise compares,
                # no sort): kept iff that mass is below top_p of the top-k mass, or nothing is better.
                n_better = tl.zeros([SLOT], dtype=tl.int32)
                better_mass = tl.zeros([SLOT], dtype=tl.float32)
                for start in range(0, count, RANK_CHUNK):
                    c = start + tl.arange(0, RANK_CHUNK)
                    other = tl.load(row_cand + c, mask=c < count, other=-9223372036854775807 - 1)
                    e_other = tl.exp((_key_to_float((other >> 32).to(tl.int32)) - m) / temp)
                    better = other[None, :] > packed[:, None]
                    n_better += tl.reduce(better.to(tl.int32), 1, _ADD)
                    better_mass += tl.reduce(tl.where(better, e_other[None, :], 0.0), 1, _ADD)
                kept = valid & ((better_mass < p * tl.reduce(e, 0, _ADD)) | (n_better == 0))
            cand_score = tl.where(kept, e / _exponential_at(seed, index, index * 0), -1.0)
            cand_best = tl.reduce(cand_score, 0, _MAX)
            token = tl.reduce(tl.where(kept & (cand_score == cand_best), index, 2147483647), 0, _MIN)
        else:
            t_score = tl.load(tile_score_ptr + row * n_tiles + t, mask=has_tile, other=0.0)
            live = has_tile & (t_max > float("-inf"))
            score = tl.where(live, t_score * tl.exp((t_max - m) / temp), -1.0)
            best = tl.reduce(score, 0, _MAX)
            token = tl.reduce(tl.where(has_tile & (score == best), t_idx, 2147483647), 0, _MIN)
            if p_on | k_on:
                x_row = x_ptr + row * x_row_stride
                rank_limit = tl.where(k_on, k, V)
                mass_limit = tl.full([], float("inf"), tl.float32)
                if p_on:
                    t_sum = tl.load(tile_sum_ptr + row * n_tiles + t, mask=has_tile, other=0.0)
                    total = tl.reduce(tl.where(live, t_sum * tl.exp((t_max - m) / temp), 0.0), 0, _ADD)
                    if k_on:
                        total = _top_k_mass(x_row, V, k, m, temp, CHUNK)
                    mass_limit = p * total
                token = _rejection_sample(x_row, V, m, temp, seed, rank_limit, mass_limit, token, CHUNK)
    tl.store(out_ptr + row, token.to(tl.int64))


# --------------------------------------------------------------------------------------------- launch
def _num_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def _rank_chunk(slot: int) -> int:
    """Candidates compared per step when ranking `slot` candidates by counting: a [slot, chunk] comparison
    of about 4096 elements keeps the per-thread share small enough not to spill."""
    return max(4, 4096 // slot)


def topk_plan(vocab: int, k: int) -> dict:
    """Launch geometry of topk for a vocabulary size and k (depends on nothing else)."""
    kp = max(16, triton.next_power_of_2(k))
    tile = max(min(MAX_TILE, triton.next_power_of_2(vocab)), kp)
    return {"slot": kp, "tile": tile, "n_tiles": triton.cdiv(vocab, tile), "group": max(2, MERGE_BLOCK // kp)}


def sample_plan(vocab: int) -> dict:
    """Launch geometry of sample: a function of the vocabulary size only, never of the batch, so a row's
    arithmetic (and its token) does not depend on which other rows share the launch."""
    tile = min(MAX_TILE, max(16, triton.next_power_of_2(vocab)))
    slot = min(SAMPLE_SLOT, max(16, triton.next_power_of_2(vocab)))
    n_tiles = triton.cdiv(vocab, tile)
    return {"tile": tile, "slot": slot, "n_tiles": n_tiles, "tiles_p2": max(2, triton.next_power_of_2(n_tiles)),
            "group": max(2, MERGE_BLOCK // slot)}


def topk_bytes_moved(batch: int, vocab: int, k: int, element_size: int) -> int:
    """DRAM bytes one `topk` call must move at least: each logit read once, and the k values (logits'
    dtype) and int64 indices of each row written. The tile candidates (8 bytes each, a few per tile) are
    scratch the merge reads back from L2; not counted."""
    return batch * (vocab * element_size + k * (element_size + 8))


def sample_bytes_moved(batch: int, vocab: int, element_size: int) -> int:
    """DRAM bytes one `sample` call must move at least: each logit read once, a row's float32 temperature
    and top_p, int32 top_k and int64 seed (the dtypes the kernels take), and its int64 token written.
    Not counted: the per-tile scratch, and the extra pass over its row that a top-p row without top-k makes
    per rejected proposal (data-dependent)."""
    return batch * (vocab * element_size + 4 + 4 + 4 + 8 + 8)


def _merge_until_one(cand, count, n_slots, slot, group, rows, k=0, k_per_row=None, exact_last=False):
    while n_slots > 1:
        n_out = triton.cdiv(n_slots, group)
        out_cand = torch.empty((rows, n_out, slot), dtype=torch.int64, device=cand.device)
        out_count = torch.empty((rows, n_out), dtype=torch.int32, device=cand.device)
        per_row = k_per_row is not None
        exact = int(exact_last and n_out == 1)
        _merge_kernel[(rows, n_out)](
            cand, count, n_slots, out_cand, out_count, n_out, k, k_per_row if per_row else count, exact,
            PER_ROW_K=per_row, SLOT=slot, GROUP=group, num_warps=_num_warps(group * slot),
        )
        cand, count, n_slots = out_cand, out_count, n_out
    return cand, count


def _topk_triton(x: torch.Tensor, k: int):
    rows, vocab = x.shape
    plan = topk_plan(vocab, k)
    slot, tile, n_tiles = plan["slot"], plan["tile"], plan["n_tiles"]
    cand = torch.empty((rows, n_tiles, slot), dtype=torch.int64, device=x.device)
    count = torch.empty((rows, n_tiles), dtype=torch.int32, device=x.device)
    _topk_tile_kernel[(rows, n_tiles)](x, x.stride(0), vocab, k, cand, count, n_tiles, TILE=tile, SLOT=slot,
                                       num_warps=_num_warps(tile))
    cand, count = _merge_until_one(cand, count, n_tiles, slot, plan["group"], rows, k=k)
    values = torch.empty((rows, k), dtype=x.dtype, device=x.device)
    indices = torch.empty((rows, k), dtype=torch.int64, device=x.device)
    _topk_finish_kernel[(rows,)](cand, count, x, x.stride(0), values, indices, k, KP=slot, RANK_CHUNK=_rank_chunk(slot),
                                 num_warps=_num_warps(slot))
    return values, indices


def _sample_triton(x, temperature, top_k, top_p, seed):
    rows, vocab = x.shape
    plan = sample_plan(vocab)
    tile, slot, n_tiles = plan["tile"], plan["slot"], plan["n_tiles"]
    dev = x.device
    tile_max = torch.empty((rows, n_tiles), dtype=torch.float32, device=dev)
    tile_sum = torch.empty_like(tile_max)
    tile_score = torch.empty_like(tile_max)
    tile_idx = torch.empty((rows, n_tiles), dtype=torch.int32, device=dev)
    cand = torch.empty((rows, n_tiles, slot), dtype=torch.int64, device=dev)
    count = torch.empty((rows, n_tiles), dtype=torch.int32, device=dev)
    _sample_tile_kernel[(rows, n_tiles)](
        x, x.stride(0), vocab, temperature, top_k, seed,
        tile_max, tile_sum, tile_score, tile_idx, cand, count, n_tiles,
        TILE=tile, SLOT=slot, num_warps=_num_warps(tile),
    )
    cand, count = _merge_until_one(cand, count, n_tiles, slot, plan["group"], rows, k_per_row=top_k, exact_last=True)
    out = torch.empty(rows, dtype=torch.int64, device=dev)
    _sample_finish_kernel[(rows,)](
        x, x.stride(0), vocab, temperature, top_k, top_p, seed,
        tile_max, tile_sum, tile_score, tile_idx, n_tiles, cand, count, out,
        TILES=plan["tiles_p2"], SLOT=slot, CHUNK=STREAM_CHUNK, RANK_CHUNK=_rank_chunk(slot), num_warps=8,
    )
    return out


# --------------------------------------------------------------------------------------------- public ops
def _check_logits(logits) -> torch.Tensor:
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, ndim=2)
    vocab = logits.shape[1]
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(f"logits must have a vocabulary (last dimension) of 1..{MAX_VOCAB}, got {vocab}")
    if vocab > 1 and logits.stride(1) != 1:
        logits = logits.contiguous()
    return logits


def topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of each row: (values [batch, k] in logits' dtype, sorted descending; indices int64).

    logits: [batch, vocab] fp32/fp16/bf16, vocab <= 262144; 1 <= k <= min(1024, vocab). The values equal
    torch.topk(logits, k).values; among equal values the lower index comes first; NaN ranks above +inf.
    """
    logits = _check_logits(logits)
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    vocab = logits.shape[1]
    if not 1 <= k <= min(MAX_K, vocab):
        raise ValueError(f"k must be in 1..min({MAX_K}, vocab={vocab}), got {k}")
    if logits.shape[0] == 0:
        return logits.new_empty((0, k)), torch.empty((0, k), dtype=torch.int64, device=logits.device)
    if not use_triton(logits):
        return topk_reference(logits, k)
    return _topk_triton(logits, k)


def _per_row(name, value, rows, device, dtypes, kind):
    """A per-row parameter as a [rows] tensor on `device`; Python numbers are broadcast."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a {kind} tensor of shape ({rows},) or a number, got bool")
    if isinstance(value, (int, float)):
        if kind == "integer" and not isinstance(value, int):
            raise TypeError(f"{name} must be an integer tensor or int, got float")
        return torch.full((rows,), value, dtype=dtypes[-1], device=device)
    check_tensor(name, value, dtypes=dtypes, ndim=1)
    if value.shape[0] != rows:
        raise ValueError(f"{name} must have shape ({rows},) (one value per row of logits), got {tuple(value.shape)}")
    return value


def sample(logits: torch.Tensor, temperature, top_k=None, top_p=None, seed=None) -> torch.Tensor:
    """One token per row from softmax(logits / temperature) restricted to the top_k / top_p set: int64 [batch].

    logits      [batch, vocab] fp32/fp16/bf16 (vocab <= 262144). NaN logits count as -inf, +inf as the
                largest finite float; a row of -inf gives index 0.
    temperature [batch] float tensor (or a number for every row). 0 means greedy: the first index of the
                max. Applied before top-k and top-p.
    top_k       None or [batch] int tensor; 0 or -1 means off (so does top_k >= vocab). Ties at the cut keep
                the lowest indices.
    top_p       None or [batch] float tensor in (0, 1]; 1.0 means off. Keeps the shortest prefix of the ranking
                (within the top-k set) whose renormalised mass reaches top_p; always at least one token.
    seed        None or [batch] int64 tensor (or an int for every row). The same seed and logits give the same
                token on the same device whatever the batch; seed=None draws seeds from torch's generator on
                the logits' device. Callers advance the seed every step (e.g. hash(request seed, position)).

    Values are checked when the tensors are on the CPU. On CUDA no value is read back (no host sync, CUDA-graph
    safe); there temperature <= 0 or NaN means greedy, top_k < 0 means off, top_p >= 1 or NaN means off and
    top_p <= 0 keeps only the top token.
    """
    logits = _check_logits(logits)
    rows, vocab = logits.shape
    device = logits.device
    temperature = _per_row("temperature", temperature, rows, device, (*FLOAT_DTYPES, torch.float64), "float")
    if top_k is not None:
        top_k = _per_row("top_k", top_k, rows, device, _INT_DTYPES, "integer")
    if top_p is not None:
        top_p = _per_row("top_p", top_p, rows, device, (*FLOAT_DTYPES, torch.float64), "float")
    if seed is not None:
        seed = _per_row("seed", seed, rows, device, _INT_DTYPES, "integer")
    check_same_device(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if device.type == "cpu":
        _check_values(temperature, top_k, top_p)
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    if not use_triton(logits):
        return sample_reference(logits, temperature, top_k, top_p, seed)
    temperature = temperature.to(torch.float32).contiguous()
    top_k = (torch.zeros(rows, dtype=torch.int32, device=device) if top_k is None
             else top_k.clamp(-1, vocab).to(torch.int32).contiguous())
    top_p = (torch.ones(rows, dtype=torch.float32, device=device) if top_p is None
             else top_p.to(torch.float32).contiguous())
    if seed is None:
        seed = torch.randint(0, 2**62, (rows,), dtype=torch.int64, device=device)
    else:
        seed = seed.to(torch.int64).contiguous()
    return _sample_triton(logits, temperature, top_k, top_p, seed)


def _check_values(temperature, top_k, top_p) -> None:
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if value is not None and not bool(satisfies(name, value).all()):
            raise ValueError(f"{name} must be {RULES[name]}")


# --------------------------------------------------------------------------------------------- AOT specs
def compile_specs():
    """Specialisations compiled for sm_80/89/90 by the compile tests and tools/inspect_triton.py."""
    from .sampling_specs import compile_specs as specs

    return specs()


__all__ = ["topk", "sample", "topk_reference", "sample_reference", "rank_keys", "order_keys", "topk_plan",
           "sample_plan", "topk_bytes_moved", "sample_bytes_moved", "MAX_VOCAB", "MAX_K"]
