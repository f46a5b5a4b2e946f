"""Project 10's Triton kernel for the `rejection` rule: one program per sequence walks its draft tokens
(three scalar loads and one Philox word each), then streams the emitting row in CHUNK-wide pieces for the
exponential race over max(0, p - q), or over p for the bonus token. The race variates are project 06's
(`_exponential_tile`: one Philox call per four tokens, keyed by the row's seed and the token index), so a
token's draw never depends on the launch. Inputs are the processed probabilities (speculative.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .keyed_random import ACCEPT_ROUND
from .sampling import _exponential_tile
from .topk_kernels import _MAX, _MIN

MAX_DRAFT_TOKENS = 16  # draft tokens per sequence: the kernel tests them all at once in a MAX_DRAFT_TOKENS vector
MAX_CHUNK = 4096  # probabilities one program holds per step (16 per thread at 8 warps)
_ACCEPT_COUNTER = tl.constexpr(ACCEPT_ROUND << 32)


@triton.jit
def _accept_uniforms(seeds):
    """Word 0 of Philox counter ACCEPT_ROUND << 32 of each seed, as (23 bits + 0.5) / 2**23
    (keyed_random.accept_uniform)."""
    r0, _, _, _ = tl.randint4x(seeds, tl.full(seeds.shape, _ACCEPT_COUNTER, tl.int64))
    return ((r0.to(tl.uint32, bitcast=True) >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07


@triton.jit
def _residual(p, q):
    """What a rejected position draws from, unnormalised: max(0, p - q)."""
    return tl.maximum(p - q, 0.0)


@triton.jit
def _race(p_row, q_row, q_len, seed, V, CHUNK: tl.constexpr):
    """argmax over the row of weight / E (E ~ Exp(1) keyed by (seed, index)), the lowest index on ties; the
    weight is the residual max(0, p - q) with q read below q_len (V after a rejection, 0 for the bonus, where
    the weight is p). Returns (token, best score)."""
    best_score = tl.full([], -1.0, tl.float32)
    best_idx = tl.full([], 2147483647, tl.int32)
    for start in range(0, V, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        valid = cols < V
        w = tl.load(p_row + cols, mask=valid, other=0.0)
        w = _residual(w, tl.load(q_row + cols, mask=cols < q_len, other=0.0))
        score = tl.where(valid, w / _exponential_tile(seed, start, CHUNK), -1.0)
        chunk_best = tl.reduce(score, 0, _MAX)
        chunk_idx = tl.reduce(tl.where(valid & (score == chunk_best), cols, 2147483647), 0, _MIN)
        better = chunk_best > best_score  # chunks come in index order: a tie keeps the earlier (lower) index
        best_score = tl.where(better, chunk_best, best_score)
        best_idx = tl.where(better, chunk_idx, best_idx)
    return best_idx, best_score


@triton.jit
def _rejection_kernel(p_ptr, q_ptr, V, draft_ptr, draft_start_ptr, seed_ptr, out_ptr, WIDTH,
                      MAX_K: tl.constexpr, CHUNK: tl.constexpr):
    b = tl.program_id(0)
    d0 = tl.load(draft_start_ptr + b)
    k = tl.load(draft_start_ptr + b + 1) - d0
    row0 = (d0 + b).to(tl.int64)
    # All k acceptance tests at once (independent loads, one Philox call); n_acc = the first rejection.
    i = tl.arange(0, MAX_K)
    has = i < k
    token = tl.load(draft_ptr + d0 + i, mask=has, other=0).to(tl.int64)
    p_x = tl.load(p_ptr + (row0 + i) * V + token, mask=has, other=0.0)
    q_x = tl.load(q_ptr + (d0 + i).to(tl.int64) * V + token, mask=has, other=0.0)
    u = _accept_uniforms(tl.load(seed_ptr + row0 + i, mask=has, other=0))
    rejects = has & ~(u * q_x < p_x)
    n_acc = tl.reduce(tl.where(rejects, i, k), 0, _MIN)
    tl.store(out_ptr + b * WIDTH + i, token, mask=i < n_acc)
    row = row0 + n_acc
    p_row = p_ptr + row * V
    q_len = tl.where(n_acc < k, V, 0)
    final, score = _race(p_row, q_ptr + (d0 + n_acc).to(tl.int64) * V, q_len, tl.load(seed_ptr + row), V, CHUNK)
    if score <= 0.0:  # p - q all zero can only come from rounding (a rejection needs p(x) < q(x))
        final, score = _race(p_row, p_row, 0, tl.load(seed_ptr + row), V, CHUNK)
    tl.store(out_ptr + b * WIDTH + n_acc, final.to(tl.int64))
    for j in range(0, WIDTH, MAX_K):
        cols = j + i
        tl.store(out_ptr + b * WIDTH + cols, tl.full([MAX_K], -1, tl.int64), mask=(cols > n_acc) & (cols < WIDTH))


def chunk_for(vocab: int) -> int:
    """The race's chunk for a vocabulary: a function of the vocabulary only, like 06's sample plan."""
    return min(MAX_CHUNK, max(16, triton.next_power_of_2(vocab)))


def _num_warps(chunk: int) -> int:
    return 8 if chunk >= 2048 else 4


def rejection_triton(p, q, draft_token_ids, layout, seed, out=None) -> torch.Tensor:
    """Launch over float32 p [T + B, V], q [T, V] (speculative._processed): int64 [B, width] (into `out`
    when given)."""
    vocab = p.shape[1]
    if out is None:
        out = torch.empty((layout.batch, layout.width), dtype=torch.int64, device=p.device)
    chunk = chunk_for(vocab)
    drafts = draft_token_ids.contiguous() if draft_token_ids.numel() else torch.zeros(1, dtype=torch.int64,
                                                                                         device=p.device)
    q = q if q.numel() else torch.zeros((1, vocab), dtype=torch.float32, device=p.device)
    _rejection_kernel[(layout.batch,)](p, q, vocab, drafts, layout.draft_start, seed.to(torch.int64).contiguous(),
                                       out, layout.width, MAX_K=MAX_DRAFT_TOKENS, CHUNK=chunk,
                                       num_warps=_num_warps(chunk))
    return out


def compile_specs():
    """Specialisations compiled for sm_80/89/90 by the compile tests and tools/inspect_triton.py: a 128K and a
    tiny (odd) vocabulary's chunk."""
    from kernel_lab.harness.compile import CompileSpec

    signature = {"p_ptr": "*fp32", "q_ptr": "*fp32", "V": "i32", "draft_ptr": "*i64", "draft_start_ptr": "*i32",
                 "seed_ptr": "*i64", "out_ptr": "*i64", "WIDTH": "i32"}
    # V is specialised as a multiple of 16 (real vocabularies are): the row offsets then allow 16-byte loads
    return [CompileSpec(name=f"rejection_chunk{c}", kernel=_rejection_kernel, signature=signature,
                        constexprs={"MAX_K": MAX_DRAFT_TOKENS, "CHUNK": c}, num_warps=_num_warps(c),
                        aligned=("p_ptr", "q_ptr", "V"))
            for c in (chunk_for(131072), chunk_for(37))]
