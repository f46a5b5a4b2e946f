"""Project 07: a tiny mixture-of-experts layer: top-k routing, alignment, grouped GEMM, combine.

    p        = softmax(router_logits) in fp32;  (w, e) = top_k(p);  w /= sum(w)  (when renormalize)
    out[t]   = sum_j  w[t, j] * ( W_down[e_j] @ silu_and_mul(W_gate_up[e_j] @ x[t]) )

Shapes: x [T, H], w_gate_up [E, 2*I, H] (gate rows, then up rows), w_down [E, H, I],
router_logits [T, E]. FLOPs: 6 * T * top_k * H * I (two GEMMs, 2*I and H output columns).

The pipeline (`route`, `align`, the two grouped GEMMs, the combine) and its design:
projects/07_moe/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, check_same_device, check_tensor, interpreter_active, use_triton
from .gemm import _grouped_tile
from .swiglu import silu_and_mul

ROUTINGS = ("torch", "kernel")  # route() + align() in torch ops, or _moe_route_align_kernel (one launch)
RASTERS = ("m_fastest", "grouped")  # program order of the two expert GEMMs (see _row_block_and_column)
GROUP_M = 8  # row blocks per group in the grouped raster


# --------------------------------------------------------------------------------------------- reference
def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, top_k], expert ids int64 [T, top_k]). Equal probabilities go to the lower
    expert id: a stable descending sort, because torch.topk leaves the order of ties unspecified."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_reference(x, w_gate_up, w_down, router_logits, top_k=2, renormalize=True) -> torch.Tensor:
    """Per-expert loop in float32: gather the expert's tokens, two matmuls, scatter-add weighted rows."""
    weights, ids = route(router_logits, top_k, renormalize)
    inter = w_down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w_gate_up.shape[0]):
        token, slot = torch.nonzero(ids == expert, as_tuple=True)
        if token.numel() == 0:
            continue
        h = x[token].float() @ w_gate_up[expert].float().t()
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        y = act @ w_down[expert].float().t()
        out.index_add_(0, token, y * weights[token, slot, None])
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------- alignment
@dataclass
class Alignment:
    sorted_ids: torch.Tensor  # int32 [max_blocks * block_m]: assignment index t*top_k + j, or A for padding
    block_expert: torch.Tensor  # int32 [max_blocks]: the expert owning each row block, E past the end
    max_blocks: int  # host-side bound used as the grid size
    block_m: int


def max_row_blocks(assignments: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sum_e ceil(count_e / block_m) over the experts actually used, from sizes only."""
    used = min(num_experts, assignments)
    return (assignments + used * (block_m - 1)) // block_m


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the assignments by expert and pad every used expert's segment to a multiple of block_m.

    Device-side torch ops only (no host synchronisation), so the step is safe inside CUDA graphs.
    Within a segment the assignments keep their original order (stable sort).
    """
    flat = ids.reshape(-1)
    assignments = flat.numel()
    device = flat.device
    max_blocks = max_row_blocks(assignments, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    padded_start = (block_end - blocks) * block_m
    unpadded_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    rank = torch.arange(assignments, device=device) - unpadded_start[expert_of_sorted]
    dest = padded_start[expert_of_sorted] + rank
    sorted_ids = torch.full((max_blocks * block_m,), assignments, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_index = torch.arange(max_blocks, device=device)
    block_expert = torch.searchsorted(block_end, block_index, right=True).to(torch.int32)
    return Alignment(sorted_ids, block_expert, max_blocks, block_m)


# --------------------------------------------------------------------------------------------- routing kernel
@triton.jit
def _route_chunk(logits_ptr, t0, tokens, num_experts, stride_lt,
                 TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """(t, e, choice, p) for tokens [t0, t0 + BLOCK_T): choice[t, e] = j when e is token t's j-th expert,
    TOP_K when not chosen; p = the (renormalised) fp32 softmax probability. Experts are picked by
    probability, ties to the lower id, as route()'s stable sort does."""
    t = t0 + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    valid = (t[:, None] < tokens) & (e[None, :] < num_experts)
    logits = tl.load(logits_ptr + t[:, None].to(tl.int64) * stride_lt + e[None, :], mask=valid,
                     other=-float("inf")).to(tl.float32)
    logits = tl.where(t[:, None] < tokens, logits, 0.0)  # rows past the end: finite, and never stored
    row_max = tl.max(logits, axis=1)
    p = tl.exp(logits - row_max[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    # padding experts rank below everything (-2) and chosen ones below every real probability (-1)
    key = tl.where(e[None, :] < num_experts, p, -2.0)
    choice = tl.full((BLOCK_T, BLOCK_E), TOP_K, dtype=tl.int32)
    chosen_sum = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pick = tl.argmax(key, axis=1, tie_break_left=True)
        hit = e[None, :] == pick[:, None]
        choice = tl.where(hit, j, choice)
        chosen_sum += tl.sum(tl.where(hit, p, 0.0), axis=1)
        key = tl.where(hit, -1.0, key)
    choice = tl.where(t[:, None] < tokens, choice, TOP_K)  # rows past the end choose nothing
    if RENORMALIZE:
        p = p / chosen_sum[:, None]
    return t, e, choice, p


@triton.jit
def _moe_route_align_kernel(
    logits_ptr, weights_ptr, ids_ptr, sorted_ids_ptr, block_expert_ptr,
    tokens, num_experts, stride_lt, max_blocks,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """route() and align() in one program: softmax + top-k per token, per-expert counts, the padded
    segment layout, block owners, padding slots, and the stable scatter of assignments into segments.
    No location is written twice and nothing written is read back, so no barrier is needed."""
    assignments = tokens * TOP_K
    # pass 1: routing outputs and per-expert counts
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for t0 in range(0, tokens, BLOCK_T):
        t, e, choice, p = _route_chunk(logits_ptr, t0, tokens, num_experts, stride_lt, TOP_K, RENORMALIZE,
                                       BLOCK_T, BLOCK_E)
        counts += tl.sum((choice < TOP_K).to(tl.int32), axis=0)
        for j in tl.static_range(TOP_K):
            hit = choice == j
            out = t.to(tl.int64) * TOP_K + j
            tl.store(ids_ptr + out, tl.sum(tl.where(hit, e[None, :], 0), axis=1), mask=t < tokens)
            tl.store(weights_ptr + out, tl.sum(tl.where(hit, p, 0.0), axis=1), mask=t < tokens)
    # segment layout: each used expert's rows padded to whole BLOCK_M row blocks, experts in id order
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    padded_start = (block_end - blocks) * BLOCK_M
    e = tl.arange(0, BLOCK_E)
    # padding experts end nowhere, so no block counts them as passed
    real_end = tl.where(e < num_experts, block_end, 2**30)
    # pass 2: owner of every row block (num_experts past the last segment) and the padding slots
    for s0 in range(0, max_blocks * BLOCK_M, BLOCK_S):
        slot = s0 + tl.arange(0, BLOCK_S)
        block = slot // BLOCK_M
        # experts whose segment ends at or before this block; segment ends grow with the expert id, so the
        # count is the last such id + 1 (a max: triton 3.9 lowered a sum of comparisons through local memory)
        owner = tl.max(tl.where(real_end[None, :] <= block[:, None], e[None, :] + 1, 0), axis=1)
        mine = e[None, :] == owner[:, None]
        local = slot - tl.sum(tl.where(mine, padded_start[None, :], 0), axis=1)
        padding = (owner >= num_experts) | (local >= tl.sum(tl.where(mine, counts[None, :], 0), axis=1))
        in_range = block < max_blocks
        tl.store(sorted_ids_ptr + slot, tl.full((BLOCK_S,), 0, tl.int32) + assignments, mask=in_range & padding)
        tl.store(block_expert_ptr + block, owner, mask=in_range & (slot % BLOCK_M == 0))
    # pass 3: each assignment t*TOP_K + j to its expert's segment, in token order (the stable sort)
    seen = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for t0 in range(0, tokens, BLOCK_T):
        t, e2, choice, p = _route_chunk(logits_ptr, t0, tokens, num_experts, stride_lt, TOP_K, RENORMALIZE,
                                        BLOCK_T, BLOCK_E)
        chosen = (choice < TOP_K).to(tl.int32)
        before = tl.cumsum(chosen, axis=0) - chosen + seen[None, :] + padded_start[None, :]
        for j in tl.static_range(TOP_K):
            dest = tl.sum(tl.where(choice == j, before, 0), axis=1)
            tl.store(sorted_ids_ptr + dest, (t * TOP_K + j).to(tl.int32), mask=t < tokens)
        seen += tl.sum(chosen, axis=0)


def route_and_align(router_logits: torch.Tensor, top_k: int, renormalize: bool, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, Alignment]:
    """route() and align() in one launch of _moe_route_align_kernel: (weights fp32 [T, top_k], expert ids
    int32 [T, top_k], the Alignment), equal to route() + align() (ids and alignment exactly, weights to
    fp32 rounding). One program walks the tokens, which suits decode; nothing synchronises with the host."""
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    tokens = router_logits.shape[0]
    device = router_logits.device
    max_blocks = max_row_blocks(tokens * top_k, num_experts, block_m)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=device)
    sorted_ids = torch.empty((max_blocks * block_m,), dtype=torch.int32, device=device)
    block_expert = torch.empty((max_blocks,), dtype=torch.int32, device=device)
    _moe_route_align_kernel[(1,)](
        router_logits, weights, ids, sorted_ids, block_expert, tokens, num_experts, router_logits.stride(0),
        max_blocks, TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_M=block_m,
        **route_align_blocks(num_experts, 1024 if interpreter_active() else 2048), num_warps=4)
    return weights, ids, Alignment(sorted_ids, block_expert, max_blocks, block_m)


def route_align_blocks(num_experts: int, tile: int = 2048) -> dict[str, int]:
    """Tile sizes of _moe_route_align_kernel: [tokens, experts] and [slots, experts] tiles of about `tile`
    elements (4 warps: 16 values per thread; twice that reaches 255 registers at top-8 of 64), at least
    16 rows."""
    block_e = max(16, triton.next_power_of_2(num_experts))
    rows = max(16, tile // block_e)
    return {"BLOCK_T": rows, "BLOCK_E": block_e, "BLOCK_S": rows}


# --------------------------------------------------------------------------------------------- kernels
@triton.jit
def _row_block_and_column(num_row_blocks, n_out, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """(row block, column tile) of this program. GROUP = 0: a 2-D grid, row blocks fastest, so the programs
    resident together share one weight column and stream every row block's activations (re-read from DRAM
    once per column when the activations outgrow L2). GROUP > 0: a 1-D grid in grouped order, GROUP row
    blocks down one column before moving right, so a group's activation panel stays in L2 across all
    columns and each weight tile is read once per group."""
    if GROUP == 0:
        return tl.program_id(0), tl.program_id(1)
    return _grouped_tile(tl.program_id(0), num_row_blocks, tl.cdiv(n_out, BLOCK_N), GROUP)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
    num_experts, num_assignments, top_k, H, I, up_offset,
    stride_xm, stride_we, stride_wn, stride_wk, stride_om, num_row_blocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FUSE_SWIGLU: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, GROUP: tl.constexpr,
):
    if FUSE_SWIGLU:
        n_out = I
    else:
        n_out = 2 * I
    pid_m, pid_n = _row_block_and_column(num_row_blocks, n_out, BLOCK_N, GROUP)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:  # past the last used expert's padded segment
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(sorted_ids_ptr + rows)
    row_valid = assignment < num_assignments
    token = (assignment // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xm + ks[None, :]
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    b_ptrs = w_expert + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_valid = ks < H - k0
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if FUSE_SWIGLU:
            b_up = tl.load(b_ptrs + up_offset, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
            if UPCAST:
                b_up = b_up.to(tl.float32)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk
    if FUSE_SWIGLU:
        # silu(g) * u in fp32 on the accumulators, then one rounding to the activation dtype
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


@triton.jit
def _moe_down_kernel(
    act_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
    num_experts, num_assignments, H, I,
    stride_am, stride_we, stride_wn, stride_wk, stride_om, num_row_blocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, GROUP: tl.constexpr,
):
    pid_m, pid_n = _row_block_and_column(num_row_blocks, H, BLOCK_N, GROUP)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(sorted_ids_ptr + rows)
    row_valid = assignment < num_assignments
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < H
    ks = tl.arange(0, BLOCK_K)
    # the activations are stored in padded (sorted) row order, so this read is contiguous per block
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    b_ptrs = w_expert + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_valid = ks < I - k0
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk
    out_ptrs = out_ptr + assignment[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc, mask=row_valid[:, None] & col_valid[None, :])


@triton.jit
def _moe_combine_kernel(
    rows_ptr, weights_ptr, out_ptr,
    top_k, H, stride_rm, stride_om,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(top_k):
        weight = tl.load(weights_ptr + token * top_k + j)
        row = tl.load(rows_ptr + (token * top_k + j) * stride_rm + cols, mask=mask, other=0.0)
        acc += weight * row
    tl.store(out_ptr + token * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    gate_up_n: int  # columns of I per program (fused: each program holds a gate and an up tile)
    down_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Rows per used expert -> tiles. Shared memory per stage stays under ~32 KiB, so num_stages * stage fits
# the 99 KiB a block may use on sm_89 (the compile tests check it). Small BLOCK_M keeps decode from
# computing padding rows; narrow N tiles give decode enough programs to stream the expert weights.
CONFIGS = (
    (16, GemmConfig(block_m=16, gate_up_n=64, down_n=32, block_k=64, num_warps=4, num_stages=4)),
    (48, GemmConfig(block_m=32, gate_up_n=64, down_n=64, block_k=64, num_warps=4, num_stages=4)),
    (96, GemmConfig(block_m=64, gate_up_n=64, down_n=64, block_k=64, num_warps=4, num_stages=4)),
    (None, GemmConfig(block_m=128, gate_up_n=64, down_n=128, block_k=64, num_warps=8, num_stages=3)),
)


def fp32_config(config: GemmConfig) -> GemmConfig:
    """fp32 runs IEEE dots on the FMA units (a correctness dtype, not a fast one). Their operands live in
    registers, so the tiles shrink until no target spills (checked by the compile tests)."""
    return replace(config, block_m=min(config.block_m, 64), gate_up_n=32, down_n=32, block_k=16, num_warps=4,
                   num_stages=2)


def choose_config(assignments: int, num_experts: int, element_size: int = 2) -> GemmConfig:
    rows_per_expert = assignments / max(1, min(num_experts, assignments))
    for limit, config in CONFIGS:
        if limit is None or rows_per_expert <= limit:
            return fp32_config(config) if element_size == 4 else config
    raise AssertionError("unreachable")


def bytes_moved(tokens: int, H: int, I: int, used_experts: float, element_size: int = 2) -> int:
    """DRAM bytes the layer must move: the gate/up and down weights of every expert some token chose
    (3 * H * I each), x read once and the output written once. What the pipeline adds on top (the
    activations and the fp32 rows between the kernels) is in projects/07_moe/README.md."""
    return int(used_experts * 3 * H * I * element_size) + 2 * tokens * H * element_size


def interpreter_config(config: GemmConfig, H: int, I: int) -> GemmConfig:
    """The interpreter's cost is per program and per op, not per element: interpreted runs keep the
    row-block height (it defines the alignment) but cover N and K with as few tiles as possible. The
    GPU tile shapes themselves are run through the interpreter by the tests via `config=`."""
    return replace(config, gate_up_n=min(128, max(16, triton.next_power_of_2(I))),
                   down_n=min(128, max(16, triton.next_power_of_2(H))),
                   block_k=min(128, max(16, triton.next_power_of_2(max(H, I)))))


def _precision(dtype: torch.dtype) -> str:
    # fp32 operands would otherwise be rounded to tf32 on the GPU (a 1e-3 relative error)
    return "ieee" if dtype == torch.float32 else "tf32"


def _gemm_grid(row_blocks: int, column_tiles: int, group: int) -> tuple[int, ...]:
    return (row_blocks * column_tiles,) if group else (row_blocks, column_tiles)


def _launch(x, w_gate_up, w_down, router_logits, top_k: int, renormalize: bool, fuse_swiglu: bool,
            config: GemmConfig | None = None, routing: str = "torch", raster: str = "m_fastest"):
    tokens, H = x.shape
    E, two_i, _ = w_gate_up.shape
    I = two_i // 2
    assignments = tokens * top_k
    if config is None:
        config = choose_config(assignments, E, x.element_size())
        if interpreter_active():
            config = interpreter_config(config, H, I)
    if routing == "kernel":
        weights, _, al = route_and_align(router_logits, top_k, renormalize, E, config.block_m)
    else:
        weights, ids = route(router_logits, top_k, renormalize)
        al = align(ids, E, config.block_m)
    group = GROUP_M if raster == "grouped" else 0
    upcast = interpreter_active() and x.dtype == torch.bfloat16
    precision = _precision(x.dtype)
    padded_rows = al.max_blocks * config.block_m
    act_width = I if fuse_swiglu else 2 * I
    act = torch.empty((padded_rows, act_width), dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[_gemm_grid(al.max_blocks, triton.cdiv(act_width, config.gate_up_n), group)](
        x, w_gate_up, act, al.sorted_ids, al.block_expert,
        E, assignments, top_k, H, I, I * w_gate_up.stride(1),
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2), act.stride(0), al.max_blocks,
        BLOCK_M=config.block_m, BLOCK_N=config.gate_up_n, BLOCK_K=config.block_k,
        FUSE_SWIGLU=fuse_swiglu, UPCAST=upcast, PRECISION=precision, GROUP=group,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if not fuse_swiglu:
        act = silu_and_mul(act)  # project 02's kernel; padding rows hold garbage that is never read
    rows = torch.empty((assignments, H), dtype=torch.float32, device=x.device)
    _moe_down_kernel[_gemm_grid(al.max_blocks, triton.cdiv(H, config.down_n), group)](
        act, w_down, rows, al.sorted_ids, al.block_expert,
        E, assignments, H, I,
        act.stride(0), w_down.stride(0), w_down.stride(1), w_down.stride(2), rows.stride(0), al.max_blocks,
        BLOCK_M=config.block_m, BLOCK_N=config.down_n, BLOCK_K=config.block_k,
        UPCAST=upcast, PRECISION=precision, GROUP=group,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    out = torch.empty((tokens, H), dtype=x.dtype, device=x.device)
    block = min(1024, max(32, triton.next_power_of_2(H)))
    _moe_combine_kernel[(tokens, triton.cdiv(H, block))](
        rows, weights.contiguous(), out, top_k, H, rows.stride(0), out.stride(0),
        BLOCK=block, num_warps=4,
    )
    return out


# --------------------------------------------------------------------------------------------- public op
def _validate(x, w_gate_up, w_down, router_logits, top_k, renormalize):
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("w_gate_up", w_gate_up, dtypes=(x.dtype,), ndim=3)
    check_tensor("w_down", w_down, dtypes=(x.dtype,), ndim=3)
    check_tensor("router_logits", router_logits, dtypes=FLOAT_DTYPES, ndim=2)
    tokens, H = x.shape
    E, two_i, h_in = w_gate_up.shape
    if H == 0:
        raise ValueError(f"x's hidden size must be >= 1, got shape {tuple(x.shape)}")
    if E == 0:
        raise ValueError(f"w_gate_up must hold at least one expert, got shape {tuple(w_gate_up.shape)}")
    if two_i == 0 or two_i % 2:
        raise ValueError(f"w_gate_up's second dimension must be 2*I (gate rows, then up rows) with I >= 1, "
                         f"got shape {tuple(w_gate_up.shape)}")
    if h_in != H:
        raise ValueError(f"w_gate_up must have shape (E, 2*I, {H}) to match x's hidden size, "
                         f"got {tuple(w_gate_up.shape)}")
    I = two_i // 2
    if tuple(w_down.shape) != (E, H, I):
        raise ValueError(f"w_down must have shape {(E, H, I)} (E, H, I from w_gate_up), got {tuple(w_down.shape)}")
    if tuple(router_logits.shape) != (tokens, E):
        raise ValueError(f"router_logits must have shape {(tokens, E)} (tokens, E), "
                         f"got {tuple(router_logits.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in [1, {E}] (E experts), got {top_k!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    check_same_device(x=x, w_gate_up=w_gate_up, w_down=w_down, router_logits=router_logits)


def moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int = 2,
    renormalize: bool = True,
    *,
    fuse_swiglu: bool = True,
    routing: str = "torch",
    raster: str = "m_fastest",
) -> torch.Tensor:
    """Mixture-of-experts MLP. x [T, H]; w_gate_up [E, 2*I, H] (gate rows, then up rows);
    w_down [E, H, I]; router_logits [T, E]. Returns [T, H] in x's dtype (fp16, bf16 or fp32; the weights
    share x's dtype). Weights may have any strides; x is copied only if its last dimension is strided.
    `fuse_swiglu=False` applies project 02's silu_and_mul between the GEMMs instead of in the epilogue.
    `routing="kernel"` runs routing and alignment as one kernel (route_and_align) instead of torch ops;
    `raster="grouped"` runs both expert GEMMs in grouped tile order instead of row blocks fastest.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if raster not in RASTERS:
        raise ValueError(f"raster must be one of {RASTERS}, got {raster!r}")
    _validate(x, w_gate_up, w_down, router_logits, top_k, renormalize)
    if not use_triton(x):
        return moe_reference(x, w_gate_up, w_down, router_logits, top_k, renormalize)
    if x.shape[0] == 0:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    return _launch(x, w_gate_up, w_down, router_logits, top_k, renormalize, fuse_swiglu, routing=routing,
                   raster=raster)


# --------------------------------------------------------------------------------------------- AOT specs
def compile_specs(all_configs: bool = False):
    """The decode (BLOCK_M 16) and prefill (BLOCK_M 128) tiles of both GEMMs in bf16, the largest fp32
    (IEEE FMA) tile of the first GEMM, and the combine: what the compile tests check for sm_80/89/90a.
    `all_configs=True` adds every CONFIGS entry, the unfused first GEMM and fp16 (about 40 compiles: too
    slow for the CPU suite, run it by hand)."""
    from kernel_lab.harness.compile import CompileSpec

    ints = {"num_experts": "i32", "num_assignments": "i32", "H": "i32", "I": "i32", "num_row_blocks": "i32"}
    aligned = ("x_ptr", "act_ptr", "w_ptr", "out_ptr", "H", "I", "up_offset", "stride_xm", "stride_am",
               "stride_we", "stride_wn", "stride_om")
    gate_up_sig = {"x_ptr": None, "w_ptr": None, "out_ptr": None, "sorted_ids_ptr": "*i32",
                   "block_expert_ptr": "*i32", **ints, "top_k": "i32", "up_offset": "i32", "stride_xm": "i32",
                   "stride_we": "i32", "stride_wn": "i32", "stride_om": "i32"}
    down_sig = {"act_ptr": None, "w_ptr": None, "out_ptr": "*fp32", "sorted_ids_ptr": "*i32",
                "block_expert_ptr": "*i32", **ints, "stride_am": "i32", "stride_we": "i32", "stride_wn": "i32",
                "stride_om": "i32"}
    # (dtype, CONFIGS limit, fused, grouped raster)
    variants = [("bf16", 16, True, False), ("bf16", None, True, False), ("fp32", None, True, False),
                ("bf16", None, True, True)]
    if all_configs:
        variants += [("bf16", 48, True, False), ("bf16", 96, True, False), ("bf16", 16, False, False),
                     ("fp16", 16, True, False), ("fp16", 16, False, False), ("bf16", 16, True, True)]
    def in_kernel_order(kernel, sig):
        return {name: sig[name] for name in kernel.arg_names if name in sig}

    specs = []
    for dtype, limit, fuse, grouped in variants:
        config = dict(CONFIGS)[limit]
        precision = "tf32"
        if dtype == "fp32":
            config, precision = fp32_config(config), "ieee"
        ty = "*" + dtype
        tag = f"{dtype}_m{config.block_m}" + ("_grouped" if grouped else "")
        group = GROUP_M if grouped else 0
        specs.append(CompileSpec(
            name=f"moe_gate_up_{tag}" + ("_fused" if fuse else ""), kernel=_moe_gate_up_kernel,
            signature=in_kernel_order(_moe_gate_up_kernel, {**gate_up_sig, "x_ptr": ty, "w_ptr": ty, "out_ptr": ty}),
            constexprs={"stride_wk": 1, "BLOCK_M": config.block_m, "BLOCK_N": config.gate_up_n,
                        "BLOCK_K": config.block_k, "FUSE_SWIGLU": fuse, "UPCAST": False, "PRECISION": precision,
                        "GROUP": group},
            num_warps=config.num_warps, num_stages=config.num_stages,
            aligned=tuple(a for a in aligned if a in gate_up_sig),
        ))
        if fuse and dtype != "fp32":
            specs.append(CompileSpec(
                name=f"moe_down_{tag}", kernel=_moe_down_kernel,
                signature=in_kernel_order(_moe_down_kernel, {**down_sig, "act_ptr": ty, "w_ptr": ty}),
                constexprs={"stride_wk": 1, "BLOCK_M": config.block_m, "BLOCK_N": config.down_n,
                            "BLOCK_K": config.block_k, "UPCAST": False, "PRECISION": "tf32", "GROUP": group},
                num_warps=config.num_warps, num_stages=config.num_stages,
                aligned=tuple(a for a in aligned if a in down_sig),
            ))
    specs.append(CompileSpec(
        name="moe_combine_bf16", kernel=_moe_combine_kernel,
        signature={"rows_ptr": "*fp32", "weights_ptr": "*fp32", "out_ptr": "*bf16", "top_k": "i32", "H": "i32",
                   "stride_rm": "i32", "stride_om": "i32"},
        constexprs={"BLOCK": 1024}, num_warps=4,
        aligned=("rows_ptr", "out_ptr", "H", "stride_rm", "stride_om"),
    ))
    for E, top_k, block_m in ((8, 2, 16), (64, 8, 128)):  # Mixtral decode; a wide router at prefill tiles
        specs.append(CompileSpec(
            name=f"moe_route_align_e{E}_k{top_k}", kernel=_moe_route_align_kernel,
            signature={"logits_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32", "sorted_ids_ptr": "*i32",
                       "block_expert_ptr": "*i32", "tokens": "i32", "num_experts": "i32", "stride_lt": "i32",
                       "max_blocks": "i32"},
            constexprs={"TOP_K": top_k, "RENORMALIZE": True, "BLOCK_M": block_m, **route_align_blocks(E)},
            num_warps=4, aligned=("logits_ptr", "stride_lt"),
        ))
    return specs
