"""Project 11: batched LoRA for a batch whose rows use different adapters (Punica's SGMV and BGMV).

    h[t]                      = x[t] @ A[a_t, s]^T                      for every slice s   (shrink)
    y[t, off_s:off_{s+1}]    += scale[a_t] * h[t, s*R:(s+1)*R] @ B[a_t, off_s:off_{s+1}]^T     (expand)

for every row t whose adapter a_t is not -1 (the base model: its rows of y are never touched).

Shapes: x [T, K]; lora_a [L, S, R, K] (L adapters, S stacked slices such as q|k|v, rank R); lora_b [L, N, R]
with slice s owning rows off_s..off_{s+1} of each adapter's B and the same columns of y [T, N]; scale fp32
[L]; h fp32 [T, S*R]. A and B are in x's dtype, or bfloat16 under float32 x on CPU (vLLM's --lora-dtype:
half the bytes, widened exactly). Adapters of a smaller rank are stored zero-padded to R (their padding adds
zeros), and an adapter that leaves a slice out stores zeros there.

Two row layouts, one kernel per step: *BGMV* (`row_adapters` [T]: one adapter index per row, decode) and *SGMV*
(`Segments`: runs of rows sharing one adapter, prefill chunks). A program owns one segment (a row, in BGMV)
and reads its adapter's A and B once. The design and the traffic model: projects/11_multi_lora/README.md.

Dispatch: CUDA tensors (and CPU tensors under TRITON_INTERPRET=1, but for bfloat16 weights under float32 x)
run the Triton kernels. On CPU, `add_lora`
with float32 x and y runs csrc/cpu/lora.c (`add_lora_cpu`: shrink and expand in one C call on gguf_linear's
pool, the form decode_stack.c calls too); other CPU calls, and any where the C library is unavailable, run
`_shrink_cpu` / `_expand_cpu`: one torch matmul per adapter present (per segment in SGMV), in fp32; a BGMV map
is grouped once per distinct map (a step's 120 projections share one), and each adapter's delta lands in one
update.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import cpu_kernels
from .common import FLOAT_DTYPES, check_same_device, check_tensor, interpreter_active, use_triton

INDEX_DTYPES = (torch.int32, torch.int64)
BLOCK_K = 64  # shrink's reduction tile over x's width (fp32: FP32_BLOCK_K, its IEEE dot holds operands in registers)
FP32_BLOCK_K = 16
BLOCK_N = 64  # expand's tile over one slice's output columns (fp32: FP32_BLOCK_N, for the same reason)
FP32_BLOCK_N = 32
# csrc/cpu/lora.c's weight_format codes: the A/B dtypes its kl_lora_bgmv reads
LORA_WEIGHT_FORMATS = {torch.float32: 0, torch.bfloat16: 1}


# --------------------------------------------------------------------------------------------- row layouts
@dataclass(frozen=True)
class Segments:
    """SGMV's layout: rows starts[g] .. starts[g] + lengths[g] - 1 use adapter adapters[g] (-1: the base model).
    Segments must not overlap; rows in no segment are left alone. `max_length` (a host int, at least every
    length) sizes the launch grid, so the kernel never reads the lengths back to the host."""

    starts: torch.Tensor
    lengths: torch.Tensor
    adapters: torch.Tensor
    max_length: int


def segments_of_runs(row_adapters: torch.Tensor) -> Segments:
    """The maximal runs of equal adapter index in row order (a host-side step: it reads the indices)."""
    check_tensor("row_adapters", row_adapters, dtypes=INDEX_DTYPES, ndim=1)
    values = row_adapters.cpu().tolist()
    starts = [i for i in range(len(values)) if i == 0 or values[i] != values[i - 1]]
    lengths = [end - start for start, end in zip(starts, starts[1:] + [len(values)])]

    def as_index(v):
        return torch.tensor(v, dtype=torch.int32, device=row_adapters.device)

    return Segments(as_index(starts), as_index(lengths), as_index([values[s] for s in starts]),
                    max(lengths, default=0))


def rows_to_adapters(segments: Segments, rows: int) -> torch.Tensor:
    """The per-row adapter index a Segments layout means (-1 for rows in no segment), as int64 on the CPU."""
    per_row = torch.full((rows,), -1, dtype=torch.int64)
    for start, length, adapter in zip(segments.starts.tolist(), segments.lengths.tolist(),
                                      segments.adapters.tolist()):
        per_row[start:start + length] = adapter
    return per_row


# --------------------------------------------------------------------------------------------- reference
def lora_reference(y, x, lora_a, lora_b, scale, slice_offsets, row_adapters) -> torch.Tensor:
    """Float64: y plus every adapted row's LoRA delta, as a new tensor (row_adapters [T], -1 = base)."""
    out = y.double().clone()
    idx = row_adapters.to(device="cpu", dtype=torch.int64)
    for t in torch.nonzero(idx >= 0).flatten().tolist():
        a = idx[t]
        for s in range(lora_a.shape[1]):
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            h = lora_a[a, s].double().cpu() @ x[t].double().cpu()
            out[t, lo:hi] += float(scale[a]) * (lora_b[a, lo:hi].double().cpu() @ h)
    return out


# --------------------------------------------------------------------------------------------- kernels
@triton.jit
def _segment(pid, seg_start_ptr, seg_len_ptr, seg_adapter_ptr, PER_ROW: tl.constexpr):
    """(first row, rows, adapter) of program `pid`'s segment: row pid itself in BGMV's layout."""
    if PER_ROW:
        return pid, 1, tl.load(seg_adapter_ptr + pid)
    return tl.load(seg_start_ptr + pid), tl.load(seg_len_ptr + pid), tl.load(seg_adapter_ptr + pid)


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, h_ptr, seg_start_ptr, seg_len_ptr, seg_adapter_ptr,
    K, R, stride_xm, stride_al, stride_as, stride_ar, stride_hm,
    PER_ROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (segment g, slice s, row block m): h[rows, s*R : s*R+R] = x[rows] @ A[adapter, s]^T."""
    start, length, adapter = _segment(tl.program_id(0), seg_start_ptr, seg_len_ptr, seg_adapter_ptr, PER_ROW)
    s = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    if (adapter < 0) | (m0 >= length):
        return
    offs_m = tl.arange(0, BLOCK_M)
    rows = (start + m0 + offs_m).to(tl.int64)
    row_valid = offs_m < length - m0
    r = tl.arange(0, BLOCK_R)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    a_ptrs = (a_ptr + adapter.to(tl.int64) * stride_al + s * stride_as + r[None, :] * stride_ar + ks[:, None])
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_valid = ks < K - k0
        xv = tl.load(x_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        av = tl.load(a_ptrs, mask=k_valid[:, None] & (r[None, :] < R), other=0.0)
        if UPCAST:
            xv = xv.to(tl.float32)
            av = av.to(tl.float32)
        acc = tl.dot(xv, av, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    h_ptrs = h_ptr + rows[:, None] * stride_hm + s * R + r[None, :]
    tl.store(h_ptrs, acc, mask=row_valid[:, None] & (r[None, :] < R))


@triton.jit
def _lora_expand_kernel(
    h_ptr, b_ptr, y_ptr, scale_ptr, slice_offsets_ptr, seg_start_ptr, seg_len_ptr, seg_adapter_ptr,
    R, tiles_per_slice, stride_hm, stride_bl, stride_bn, stride_ym,
    PER_ROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (segment g, slice s and column tile, row block m): y[rows, cols] += scale * h_s @ B_s^T."""
    start, length, adapter = _segment(tl.program_id(0), seg_start_ptr, seg_len_ptr, seg_adapter_ptr, PER_ROW)
    s = tl.program_id(1) // tiles_per_slice
    n_lo = tl.load(slice_offsets_ptr + s)
    n_hi = tl.load(slice_offsets_ptr + s + 1)
    n0 = n_lo + (tl.program_id(1) % tiles_per_slice) * BLOCK_N
    m0 = tl.program_id(2) * BLOCK_M
    if (adapter < 0) | (m0 >= length) | (n0 >= n_hi):
        return
    offs_m = tl.arange(0, BLOCK_M)
    rows = (start + m0 + offs_m).to(tl.int64)
    row_valid = offs_m < length - m0
    r = tl.arange(0, BLOCK_R)
    cols = n0 + tl.arange(0, BLOCK_N)
    col_valid = cols < n_hi
    hv = tl.load(h_ptr + rows[:, None] * stride_hm + s * R + r[None, :],
                 mask=row_valid[:, None] & (r[None, :] < R), other=0.0)
    bv = tl.load(b_ptr + adapter.to(tl.int64) * stride_bl + cols[None, :].to(tl.int64) * stride_bn + r[:, None],
                 mask=(r[:, None] < R) & col_valid[None, :], other=0.0)
    if UPCAST:
        bv = bv.to(tl.float32)
    else:
        hv = hv.to(bv.dtype)  # half weights: h rounds once to the tensor-core operand type
    delta = tl.dot(hv, bv, input_precision=PRECISION) * tl.load(scale_ptr + adapter)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    mask = row_valid[:, None] & col_valid[None, :]
    yv = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (yv.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------- launches
def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot needs a reduction of at least 16


def _block_m(max_length: int) -> int:
    return 16 if max_length <= 16 else 64


def _block_k(dtype: torch.dtype | str) -> int:
    return FP32_BLOCK_K if dtype in (torch.float32, "fp32") else BLOCK_K


def _block_n(dtype: torch.dtype | str) -> int:
    return FP32_BLOCK_N if dtype in (torch.float32, "fp32") else BLOCK_N


def _num_warps(block_m: int) -> int:
    return 8 if block_m == 64 else 4


def _kernel_flags(dtype: torch.dtype) -> dict:
    """bf16 dots are upcast under the interpreter (Triton 3.9 multiplies their raw bits); fp32 stays IEEE."""
    return {"UPCAST": dtype == torch.bfloat16 and interpreter_active(),
            "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def _layout(rows: int, row_adapters, segments):
    """(starts, lengths, adapters, programs along the segment axis, max rows per program, per-row layout).
    BGMV's kernels never read the start and length pointers, so row_adapters stands in for them."""
    if row_adapters is not None:
        return row_adapters, row_adapters, row_adapters, rows, 1, True
    return segments.starts, segments.lengths, segments.adapters, segments.adapters.shape[0], segments.max_length, False


@functools.lru_cache(maxsize=64)
def _offsets_tensor(slice_offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(slice_offsets, dtype=torch.int32, device=device)


def _shrink_triton(x, lora_a, h, row_adapters, segments) -> None:
    starts, lengths, adapters, groups, max_length, per_row = _layout(x.shape[0], row_adapters, segments)
    L, S, R, K = lora_a.shape
    block_m = _block_m(max_length)
    grid = (groups, S, triton.cdiv(max_length, block_m))
    if groups == 0 or max_length == 0:
        return
    _lora_shrink_kernel[grid](
        x, lora_a, h, starts, lengths, adapters, K, R, x.stride(0), lora_a.stride(0), lora_a.stride(1),
        lora_a.stride(2), h.stride(0), PER_ROW=per_row, BLOCK_M=block_m, BLOCK_R=_block_r(R), BLOCK_K=_block_k(x.dtype),
        **_kernel_flags(x.dtype), num_warps=_num_warps(block_m),
    )


def _expand_triton(y, h, lora_b, scale, slice_offsets, row_adapters, segments) -> None:
    starts, lengths, adapters, groups, max_length, per_row = _layout(y.shape[0], row_adapters, segments)
    lora_b = lora_b if lora_b.stride(-1) == 1 else lora_b.contiguous()  # the kernel reads rank-contiguous rows
    R = lora_b.shape[2]
    widest = max(hi - lo for lo, hi in zip(slice_offsets, slice_offsets[1:]))
    tiles = triton.cdiv(widest, _block_n(y.dtype))
    block_m = _block_m(max_length)
    if groups == 0 or max_length == 0:
        return
    grid = (groups, (len(slice_offsets) - 1) * tiles, triton.cdiv(max_length, block_m))
    _lora_expand_kernel[grid](
        h, lora_b, y, scale, _offsets_tensor(tuple(slice_offsets), y.device), starts, lengths, adapters,
        R, tiles, h.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        PER_ROW=per_row, BLOCK_M=block_m, BLOCK_N=_block_n(y.dtype), BLOCK_R=_block_r(R), **_kernel_flags(y.dtype),
        num_warps=_num_warps(block_m),
    )


# --------------------------------------------------------------------------------------------- CPU path
# The engine passes one row map to every projection of a step (120 calls on a 30-layer model): its groups are
# found once per map, not once per call. Keyed by a copy of the map's values (a static buffer refilled in
# place must not find the previous step's groups).
_row_groups_memo: list = [None, ()]


def _row_groups(row_adapters: torch.Tensor) -> tuple:
    memo = _row_groups_memo
    if memo[0] is not None and memo[0].shape == row_adapters.shape and torch.equal(memo[0], row_adapters):
        return memo[1]
    idx = row_adapters.long()
    groups = []
    for adapter in torch.unique(idx).tolist():
        if adapter >= 0:
            rows = torch.nonzero(idx == adapter).flatten()
            # every row on one adapter: a slice, so x[rows] is a view and y is updated in place
            groups.append((adapter, slice(0, len(idx)) if len(rows) == len(idx) else rows))
    memo[:] = [row_adapters.clone(), tuple(groups)]
    return memo[1]


def _cpu_groups(row_adapters, segments):
    """(adapter, rows) pairs for the adapted rows: a slice per SGMV segment, an index per adapter in BGMV."""
    if segments is not None:
        return [(adapter, slice(start, start + length)) for start, length, adapter in
                zip(segments.starts.tolist(), segments.lengths.tolist(), segments.adapters.tolist())
                if adapter >= 0 and length > 0]
    return _row_groups(row_adapters)


def _shrink_cpu(x, lora_a, h, row_adapters, segments) -> None:
    L, S, R, K = lora_a.shape
    for adapter, rows in _cpu_groups(row_adapters, segments):
        h[rows] = x[rows].float() @ lora_a[adapter].reshape(S * R, K).float().t()


def _expand_cpu(y, h, lora_b, scale, slice_offsets, row_adapters, segments) -> None:
    """One delta [rows, N] per adapter (its slices side by side), added to y's rows in one update: fp32 y
    gets y + delta rounded once, as the per-slice form did."""
    R = lora_b.shape[2]
    pairs = list(zip(slice_offsets, slice_offsets[1:]))
    for adapter, rows in _cpu_groups(row_adapters, segments):
        hs = h[rows].float() * float(scale[adapter])
        b = lora_b[adapter].float()
        parts = [hs[:, s * R:(s + 1) * R] @ b[lo:hi].t() for s, (lo, hi) in enumerate(pairs)]
        delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if y.dtype == torch.float32 and isinstance(rows, torch.Tensor):
            y.index_add_(0, rows, delta)
        elif y.dtype == torch.float32:
            y[rows] += delta
        else:
            y[rows] = (y[rows].float() + delta).to(y.dtype)


@functools.lru_cache(maxsize=256)
def _offset_words(offsets: tuple[int, ...]):
    return (cpu_kernels.ctypes.c_int64 * len(offsets))(*offsets)


def add_lora_cpu(y, x, lora_a, lora_b, scale, offsets: tuple[int, ...], row_adapters, segments,
                 threads: int | None = None, library=None) -> bool:
    """csrc/cpu/lora.c's BGMV (SGMV segments as their row map) into y in place, if it applies: CPU float32 x, y,
    weights and scale. False (nothing written): use the torch path. Shapes and index values are the caller's
    checks. `threads`: at most this many of the pool's threads (default `cpu_kernels.attention_threads()`); the
    bits are the same for any count. `library`: another build (the tests' narrowed ISA builds)."""
    if not (x.dtype == y.dtype == torch.float32 and lora_a.dtype == lora_b.dtype in LORA_WEIGHT_FORMATS
            and y.device.type == "cpu"):
        return False
    lib = library if library is not None else cpu_kernels.load_library("lora")
    if lib is None:
        return False
    if row_adapters is None:
        row_adapters = rows_to_adapters(segments, x.shape[0])
    slots = row_adapters if row_adapters.dtype == torch.int32 and row_adapters.is_contiguous() \
        else row_adapters.to(torch.int32).contiguous()
    lora_a, scale = lora_a.contiguous(), scale.contiguous()
    L, S, R, K = lora_a.shape
    status = lib.kl_lora_bgmv(y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), x.shape[0], K, y.shape[1],
                              slots.data_ptr(), L, lora_a.data_ptr(), lora_b.data_ptr(),
                              LORA_WEIGHT_FORMATS[lora_a.dtype], *lora_b.stride(),
                              scale.data_ptr(), S, R, _offset_words(offsets), cpu_kernels.attention_threads(threads))
    if status != 0:
        raise RuntimeError(f"kl_lora_bgmv failed with status {status}")
    return True


# --------------------------------------------------------------------------------------------- validation
def _check_rows_or_segments(data_name: str, data: torch.Tensor, num_adapters: int, row_adapters, segments,
                            validate) -> None:
    """Exactly one layout for `data`'s rows; its shapes always, and (validate) its values, which need a host
    read on CUDA."""
    rows, device = data.shape[0], data.device
    if (row_adapters is None) == (segments is None):
        raise ValueError("pass exactly one of row_adapters (BGMV: one adapter per row) and segments (SGMV)")
    if row_adapters is not None:
        check_tensor("row_adapters", row_adapters, dtypes=INDEX_DTYPES, ndim=1)
        if row_adapters.shape[0] != rows:
            raise ValueError(f"row_adapters must have one entry per row ({rows}), got shape "
                             f"{tuple(row_adapters.shape)}")
        check_same_device(**{data_name: data}, row_adapters=row_adapters)
        tensors = {"row_adapters": row_adapters}
    else:
        if not isinstance(segments, Segments):
            raise TypeError(f"segments must be a kernel_lab.ops.lora.Segments, got {type(segments).__name__}")
        groups = segments.adapters.shape[0] if isinstance(segments.adapters, torch.Tensor) else None
        for name in ("starts", "lengths", "adapters"):
            t = check_tensor(f"segments.{name}", getattr(segments, name), dtypes=INDEX_DTYPES, ndim=1)
            if t.shape[0] != groups:
                raise ValueError(f"segments.{name} must have one entry per segment ({groups}), got shape "
                                 f"{tuple(t.shape)}")
            check_same_device(**{data_name: data, f"segments.{name}": t})
        if isinstance(segments.max_length, bool) or not isinstance(segments.max_length, int) \
                or segments.max_length < 0:
            raise ValueError(f"segments.max_length must be an int >= 0, got {segments.max_length!r}")
        tensors = {"segments.adapters": segments.adapters}
    if not (validate or (validate is None and device.type == "cpu")):
        return
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("validate=True reads device memory and cannot run inside CUDA graph capture")
    for name, t in tensors.items():
        if t.numel() and not (-1 <= int(t.min()) and int(t.max()) < num_adapters):
            raise ValueError(f"{name} must hold adapter indices in [-1, {num_adapters}) (-1: the base model), "
                             f"got values in [{int(t.min())}, {int(t.max())}]")
    if segments is not None:
        starts, lengths = segments.starts.long().cpu(), segments.lengths.long().cpu()
        if lengths.numel() and int(lengths.min()) < 0:
            raise ValueError(f"segments.lengths must be >= 0, got {lengths.tolist()}")
        if lengths.numel() and int(lengths.max()) > segments.max_length:
            raise ValueError(f"segments.max_length ({segments.max_length}) must be at least every segment's "
                             f"length, got lengths up to {int(lengths.max())}")
        if starts.numel() and (int(starts.min()) < 0 or int((starts + lengths).max()) > rows):
            raise ValueError(f"segments must lie within the {rows} rows, got starts {starts.tolist()} and "
                             f"lengths {lengths.tolist()}")
        order = torch.argsort(starts)
        ends = (starts + lengths)[order]
        if bool((ends[:-1] > starts[order][1:]).any()):
            raise ValueError(f"segments must not overlap, got starts {starts.tolist()} and lengths "
                             f"{lengths.tolist()}")


def _check_slice_offsets(slice_offsets, num_slices: int, width: int) -> tuple[int, ...]:
    offsets = tuple(slice_offsets) if isinstance(slice_offsets, Sequence) else None
    if (offsets is None or len(offsets) != num_slices + 1 or any(isinstance(o, bool) or not isinstance(o, int)
                                                                 for o in offsets)
            or offsets[0] != 0 or offsets[-1] != width or any(b <= a for a, b in zip(offsets, offsets[1:]))):
        raise ValueError(f"slice_offsets must be {num_slices + 1} increasing ints from 0 to {width} (one slice "
                         f"per stacked projection, ending at y's width), got {slice_offsets!r}")
    return offsets


def _check_weights(name: str, t: torch.Tensor, dtype, ndim: int) -> None:
    """A or B: in the activations' dtype, or bfloat16 under float32 activations on CPU (module docstring)."""
    narrow = dtype == torch.float32 and t.device.type == "cpu"
    check_tensor(name, t, dtypes=(dtype, torch.bfloat16) if narrow else (dtype,), ndim=ndim)
    if t.stride(-1) == 1:
        return
    if name == "lora_b" and t.device.type == "cpu" and t.stride(1) == 1:
        return  # B stored [L, R, N] (the engine's CPU slots): the C kernel's fast layout, any path reads it
    raise ValueError(f"{name} must be contiguous in its last dimension (stride 1)"
                     f"{' (on CPU, or in its second: [L, R, N] storage)' if name == 'lora_b' else ''}, got "
                     f"strides {t.stride()}")


def _check_shrink(x, lora_a, h):
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    _check_weights("lora_a", lora_a, x.dtype, 4)
    L, S, R, K = lora_a.shape
    if K != x.shape[1] or L == 0 or S == 0 or R == 0:
        raise ValueError(f"lora_a must have shape (adapters >= 1, slices >= 1, rank >= 1, {x.shape[1]} = x's "
                         f"width), got {tuple(lora_a.shape)}")
    if h is not None:
        check_tensor("out", h, dtypes=(torch.float32,), ndim=2)
        if tuple(h.shape) != (x.shape[0], S * R) or h.stride(-1) != 1:
            raise ValueError(f"out must be a float32 ({x.shape[0]}, {S * R}) tensor (rows, slices * rank), "
                             f"contiguous in its last dimension, got shape {tuple(h.shape)}")
    check_same_device(x=x, lora_a=lora_a, out=h)


def _check_expand(y, h, lora_b, scale, slice_offsets, num_slices: int | None = None):
    """The expand's arguments; `num_slices` instead of h (None) where no h exists (add_lora's one C call)."""
    check_tensor("y", y, dtypes=FLOAT_DTYPES, ndim=2)
    if y.stride(-1) != 1:
        raise ValueError(f"y is updated in place and must be contiguous in its last dimension, got strides "
                         f"{y.stride()}")
    _check_weights("lora_b", lora_b, y.dtype, 3)
    L, N, R = lora_b.shape
    if N != y.shape[1] or L == 0 or R == 0:
        raise ValueError(f"lora_b must have shape (adapters >= 1, {y.shape[1]} = y's width, rank >= 1), got "
                         f"{tuple(lora_b.shape)}")
    if h is not None:
        check_tensor("h", h, dtypes=(torch.float32,), ndim=2)
        if h.shape[0] != y.shape[0] or h.shape[1] == 0 or h.shape[1] % R or h.stride(-1) != 1:
            raise ValueError(f"h must be float32 ({y.shape[0]}, slices * {R}) (y's rows, lora_b's rank), "
                             f"contiguous in its last dimension, got shape {tuple(h.shape)}")
        num_slices = h.shape[1] // R
    offsets = _check_slice_offsets(slice_offsets, num_slices, N)
    check_tensor("scale", scale, dtypes=(torch.float32,), ndim=1)
    if scale.shape[0] != L:
        raise ValueError(f"scale must hold one float32 per adapter ({L}), got shape {tuple(scale.shape)}")
    check_same_device(y=y, h=h, lora_b=lora_b, scale=scale)
    return offsets


# --------------------------------------------------------------------------------------------- public ops
def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, *, row_adapters: torch.Tensor | None = None,
                segments: Segments | None = None, out: torch.Tensor | None = None,
                validate: bool | None = None) -> torch.Tensor:
    """h = x @ A[adapter, s]^T for every slice s, fp32 [T, S*R]. Rows of the base model (-1) and rows in no
    segment are not written (a new `out` starts at zero). `validate` (default: on for CPU tensors) checks the
    index values on the host."""
    _check_shrink(x, lora_a, out)
    _check_rows_or_segments("x", x, lora_a.shape[0], row_adapters, segments, validate)
    L, S, R, K = lora_a.shape
    h = out if out is not None else torch.zeros((x.shape[0], S * R), dtype=torch.float32, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    (_shrink_triton if use_triton(x) and lora_a.dtype == x.dtype else _shrink_cpu)(x, lora_a, h, row_adapters,
                                                                                  segments)
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, scale: torch.Tensor,
                slice_offsets: Sequence[int], *, row_adapters: torch.Tensor | None = None,
                segments: Segments | None = None, validate: bool | None = None) -> torch.Tensor:
    """y[:, off_s:off_{s+1}] += scale[adapter] * h[:, s*R:(s+1)*R] @ B[adapter, off_s:off_{s+1}]^T, in place,
    for the adapted rows; returns y. slice_offsets: the host ints 0 = off_0 < ... < off_S = y's width (their
    device copy is cached per device: call once before capturing a CUDA graph)."""
    offsets = _check_expand(y, h, lora_b, scale, slice_offsets)
    _check_rows_or_segments("y", y, lora_b.shape[0], row_adapters, segments, validate)
    (_expand_triton if use_triton(y) and lora_b.dtype == y.dtype else _expand_cpu)(y, h, lora_b, scale, offsets,
                                                                                   row_adapters, segments)
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: torch.Tensor,
             slice_offsets: Sequence[int], *, row_adapters: torch.Tensor | None = None,
             segments: Segments | None = None, validate: bool | None = None) -> torch.Tensor:
    """One LoRA projection over a mixed batch: shrink, then expand into y in place (the module docstring)."""
    if lora_a.dim() == 4 and lora_b.dim() == 3 and (lora_a.shape[0], lora_a.shape[2]) != (lora_b.shape[0],
                                                                                         lora_b.shape[2]):
        raise ValueError(f"lora_b must hold as many adapters (dim 0) of the same rank (dim 2) as lora_a: lora_a "
                         f"has shape {tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}")
    if x.dim() == 2 and y.dim() == 2 and x.shape[0] != y.shape[0]:
        raise ValueError(f"y must have x's {x.shape[0]} rows, got shape {tuple(y.shape)}")
    # bfloat16 weights under float32 x (CPU only) take the C kernel even under the interpreter: the Triton
    # kernels read weights in x's dtype
    if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dtype == torch.float32 and (
            not use_triton(x) or getattr(lora_a, "dtype", None) == torch.bfloat16):
        _check_shrink(x, lora_a, None)   # one C call, with the two steps' checks
        offsets = _check_expand(y, None, lora_b, scale, slice_offsets, num_slices=lora_a.shape[1])
        _check_rows_or_segments("x", x, lora_a.shape[0], row_adapters, segments, validate)
        if add_lora_cpu(y, x if x.stride(-1) == 1 else x.contiguous(), lora_a, lora_b, scale, offsets,
                        row_adapters, segments):
            return y
    if lora_a.dim() == 4 and x.dim() == 2:  # expand reads only the rows shrink writes: no zero fill needed
        out = torch.empty((x.shape[0], lora_a.shape[1] * lora_a.shape[2]), dtype=torch.float32, device=x.device)
    else:
        out = None  # lora_shrink names the bad argument
    h = lora_shrink(x, lora_a, row_adapters=row_adapters, segments=segments, out=out, validate=validate)
    # shrink checked the layout's values against the same rows and adapters
    return lora_expand(y, h, lora_b, scale, slice_offsets, row_adapters=row_adapters, segments=segments,
                       validate=False)


# --------------------------------------------------------------------------------------------- traffic
def bytes_moved(rows: int, segments: int, in_features: int, out_features: int, rank: int, num_slices: int,
                element_size: int, op: str = "both") -> int:
    """The fewest DRAM bytes of one call over `rows` adapted rows: x once; A (S*R*K) and B (N*R) once per
    entry of `segments` (SGMV: its segments; BGMV: the distinct adapters in the batch, since each row's
    program reads its adapter's weights and the repeats come from L2); h written by shrink and read by expand
    in fp32; y read and written by expand. op: "shrink", "expand" or "both"."""
    h_bytes = rows * num_slices * rank * 4
    shrink = rows * in_features * element_size + segments * num_slices * rank * in_features * element_size + h_bytes
    expand = h_bytes + segments * out_features * rank * element_size + 2 * rows * out_features * element_size
    return {"shrink": shrink, "expand": expand, "both": shrink + expand}[op]


# --------------------------------------------------------------------------------------------- AOT specs
def compile_specs():
    """Shrink and expand: BGMV in bf16 at rank 16 and fp16 at rank 64, SGMV (64-row blocks) in bf16 and fp32
    (IEEE, the smaller tiles) at rank 64, the largest register footprint of each."""
    from kernel_lab.harness.compile import CompileSpec

    specs = []
    for dtype, rank, per_row in (("bf16", 16, True), ("bf16", 64, False), ("fp16", 64, True), ("fp32", 64, False)):
        ty = "*" + dtype
        layout = "bgmv" if per_row else "sgmv"
        block_m = 16 if per_row else 64
        precision = "ieee" if dtype == "fp32" else "tf32"
        index = {"seg_start_ptr": "*i32", "seg_len_ptr": "*i32", "seg_adapter_ptr": "*i32"}
        specs.append(CompileSpec(
            name=f"lora_shrink_{layout}_{dtype}_r{rank}", kernel=_lora_shrink_kernel,
            signature={"x_ptr": ty, "a_ptr": ty, "h_ptr": "*fp32", **index, "K": "i32", "R": "i32",
                       "stride_xm": "i32", "stride_al": "i32", "stride_as": "i32", "stride_ar": "i32",
                       "stride_hm": "i32"},
            constexprs={"PER_ROW": per_row, "BLOCK_M": block_m, "BLOCK_R": _block_r(rank),
                        "BLOCK_K": _block_k(dtype), "UPCAST": False, "PRECISION": precision},
            num_warps=_num_warps(block_m),
            aligned=("x_ptr", "a_ptr", "h_ptr", "K", "stride_xm", "stride_al", "stride_as", "stride_ar", "stride_hm"),
        ))
        specs.append(CompileSpec(
            name=f"lora_expand_{layout}_{dtype}_r{rank}", kernel=_lora_expand_kernel,
            signature={"h_ptr": "*fp32", "b_ptr": ty, "y_ptr": ty, "scale_ptr": "*fp32", "slice_offsets_ptr": "*i32",
                       **index, "R": "i32", "tiles_per_slice": "i32", "stride_hm": "i32", "stride_bl": "i32",
                       "stride_bn": "i32", "stride_ym": "i32"},
            constexprs={"PER_ROW": per_row, "BLOCK_M": block_m, "BLOCK_N": _block_n(dtype), "BLOCK_R": _block_r(rank),
                        "UPCAST": False, "PRECISION": precision},
            num_warps=_num_warps(block_m),
            aligned=("h_ptr", "b_ptr", "y_ptr", "stride_hm", "stride_bl", "stride_bn", "stride_ym"),
        ))
    return specs
