"""Project 01: RMSNorm and fused residual-add + RMSNorm.

    y = x / sqrt(mean(x^2) + eps) * weight            (computed in fp32, stored in x's dtype)

Memory traffic, the two kernels (row in registers; looped for very long rows) and why: projects/01_rmsnorm/README.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cpu_kernels
from .common import (
    FLOAT_DTYPES,
    as_rows,
    check_last_dim_contiguous,
    check_same_device,
    check_tensor,
    rows_view,
    use_triton,
)

FUSED_MAX_H = 16384  # above this the looped kernel is used; see compile tests for the spill-free proof
LOOP_CHUNK = 4096
VARIANTS = ("auto", "multirow")  # auto: one row per program (looped above FUSED_MAX_H)
MULTIROW_ELEMENTS = 64  # elements of a row per thread in the multirow kernel
MULTIROW_ROWS = 4  # rows per program, at most
MULTIROW_SPREAD = 1024  # a program takes one more row per this many rows (up to MULTIROW_ROWS)
MULTIROW_MAX_H = 32768  # up to here the multirow kernel keeps the row in registers; above, the looped one runs


# --------------------------------------------------------------------------------------------- reference
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def fused_add_rms_norm_reference(x, residual, weight, eps=1e-6):
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_reference(new_residual, weight, eps), new_residual


def _rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x [+ residual]), x + residual or None) on the CPU: float32 through the C kernel
    (csrc/cpu/norm_activation.c; a CPU decode step runs 61 norms, where torch's ops cost tens of
    microseconds each), anything else, or without the kernel, the reference."""
    if x.dtype == weight.dtype == torch.float32:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        new_residual = None if residual is None else torch.empty_like(out)
        if cpu_kernels.add_rms_norm_cpu(x, residual, weight, eps, out, new_residual):
            return out, new_residual
    if residual is None:
        return rms_norm_reference(x, weight, eps), None
    return fused_add_rms_norm_reference(x, residual, weight, eps)


# --------------------------------------------------------------------------------------------- kernels
@triton.jit
def _normalize_row(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, row, cols, mask,
                   H, x_row_stride, res_row_stride, out_row_stride, res_out_row_stride, eps,
                   HAS_RESIDUAL: tl.constexpr):
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    # Issued before the reduction so its latency hides behind the cross-warp sum.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0)
        # The new residual is rounded to the activation dtype first, exactly as an unfused add would be,
        # and the norm is taken of that rounded value.
        summed = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * res_out_row_stride + cols, summed, mask=mask)
        x = summed
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    tl.store(out_ptr + row * out_row_stride + cols, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_row_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    H, x_row_stride, res_row_stride, out_row_stride, res_out_row_stride, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    _normalize_row(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, tl.program_id(0).to(tl.int64), cols, cols < H,
                   H, x_row_stride, res_row_stride, out_row_stride, res_out_row_stride, eps, HAS_RESIDUAL)


@triton.jit
def _rms_norm_multirow_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    rows, H, x_row_stride, res_row_stride, out_row_stride, res_out_row_stride, eps, ROWS_PER_PROGRAM,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    # ROWS_PER_PROGRAM consecutive rows, one after another, on few threads per row (launch_config_multirow):
    # each thread keeps its whole share of a row in registers from the load to the normalising store, and
    # the weight row, re-read for every row, should hit in this SM's L1.
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    first = tl.program_id(0).to(tl.int64) * ROWS_PER_PROGRAM
    for i in range(ROWS_PER_PROGRAM):
        row = first + i
        if row < rows:
            _normalize_row(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, row, cols, mask,
                           H, x_row_stride, res_row_stride, out_row_stride, res_out_row_stride, eps, HAS_RESIDUAL)


@triton.jit
def _rms_norm_looped_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    H, x_row_stride, res_row_stride, out_row_stride, res_out_row_stride, eps,
    CHUNK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, H, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        mask = cols < H
        x = tl.load(x_row + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(res_out_ptr + row * res_out_row_stride + cols, x, mask=mask)
        xf = x.to(tl.float32)
        acc += xf * xf
    rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / H + eps)
    # Second pass re-reads what the first pass produced (the new residual when fused).
    if HAS_RESIDUAL:
        src_row = res_out_ptr + row * res_out_row_stride
    else:
        src_row = x_row
    for start in range(0, H, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        mask = cols < H
        xf = tl.load(src_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_row_stride + cols, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def launch_config(H: int) -> tuple[bool, int, int]:
    """(looped, block, num_warps) for a row of H elements.

    The row kernel keeps BLOCK = next_pow2(H) elements in registers; with 8 warps each thread holds
    BLOCK/256 elements, i.e. whole 128-bit vectors from H = 2048 (fp16/bf16) upward.
    """
    if H > FUSED_MAX_H:
        return True, LOOP_CHUNK, 8
    block = triton.next_power_of_2(H)
    num_warps = max(1, min(16 if block >= 16384 else 8, block // 256))
    return False, block, num_warps


def bytes_moved(rows: int, H: int, element_size: int, residual: bool = False,
                weight_element_size: int | None = None) -> int:
    """DRAM bytes one call must move: rms_norm reads x and writes y; fused_add_rms_norm also reads the
    residual and writes the new one. The weight row is counted once (it stays in L2/L1 across rows). A
    kernel that re-reads the row (the looped one) moves more than this; GB/s are quoted against it."""
    streams = 4 if residual else 2
    return streams * rows * H * element_size + H * (weight_element_size or element_size)


def launch_config_multirow(rows: int, H: int) -> tuple[int, int, int]:
    """(block, num_warps, rows per program) of the multirow kernel, for H <= MULTIROW_MAX_H.

    Few threads per row, as QuACK's Hopper configuration has (32/64/128 threads for rows up to 3K/6K/16K):
    each thread holds MULTIROW_ELEMENTS of a row (eight 16-byte vectors in bf16), so a row takes
    H / 64 threads (128 at H = 8192, 512 at 32768), the per-row reduction crosses few warps, and registers
    stay low enough for several CTAs per SM. A program then walks up to MULTIROW_ROWS rows; below
    MULTIROW_ROWS * MULTIROW_SPREAD rows it takes fewer, so small batches still spread over the SMs.
    """
    block = triton.next_power_of_2(H)
    num_warps = max(1, min(16, block // (32 * MULTIROW_ELEMENTS)))
    rows_per_program = max(1, min(MULTIROW_ROWS, rows // MULTIROW_SPREAD))
    return block, num_warps, rows_per_program


def _launch(x2, res2, weight, out2, res_out2, eps: float, variant: str = "auto") -> None:
    rows, H = x2.shape
    if rows == 0:
        return
    has_res = res2 is not None
    if variant == "multirow" and H <= MULTIROW_MAX_H:
        block, num_warps, per_program = launch_config_multirow(rows, H)
        _rms_norm_multirow_kernel[(triton.cdiv(rows, per_program),)](
            x2, res2 if has_res else x2, weight, out2, res_out2 if has_res else out2,
            rows, H, x2.stride(0), res2.stride(0) if has_res else 0, out2.stride(0),
            res_out2.stride(0) if has_res else 0, eps, per_program,
            BLOCK=block, HAS_RESIDUAL=has_res, num_warps=num_warps)
        return
    looped, block, num_warps = launch_config(H)
    args = (
        x2, res2 if has_res else x2, weight, out2, res_out2 if has_res else out2,
        H, x2.stride(0), res2.stride(0) if has_res else 0, out2.stride(0),
        res_out2.stride(0) if has_res else 0, eps,
    )
    if looped:
        _rms_norm_looped_kernel[(rows,)](*args, CHUNK=block, HAS_RESIDUAL=has_res, num_warps=num_warps)
    else:
        _rms_norm_row_kernel[(rows,)](*args, BLOCK=block, HAS_RESIDUAL=has_res, num_warps=num_warps)


# --------------------------------------------------------------------------------------------- public ops
def _validate(x, weight, eps, residual=None, variant="auto"):
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    check_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=1)
    if x.shape[-1] < 1:
        raise ValueError(f"x's last dimension (hidden size) must be >= 1, got shape {tuple(x.shape)}")
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must have shape ({x.shape[-1]},) to match x's last dimension, got {tuple(weight.shape)}")
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,))
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    check_same_device(x=x, weight=weight, residual=residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None, *,
             variant: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dimension. x: [..., H] fp16/bf16/fp32; weight: [H]. Returns x's dtype.
    variant (Triton only): "auto" (one row per program) or "multirow" (several rows per program on fewer
    threads per row; H > MULTIROW_MAX_H takes the looped kernel either way)."""
    _validate(x, weight, eps, variant=variant)
    if out is not None:
        check_tensor("out", out, dtypes=(x.dtype,))
        if out.shape != x.shape or out.device != x.device:
            raise ValueError(
                f"out must be a {tuple(x.shape)} tensor on {x.device}, got {tuple(out.shape)} on {out.device}")
        check_last_dim_contiguous("out", out)
    if not use_triton(x):
        y, _ = _rms_norm_cpu(x, weight, eps)
        return out.copy_(y) if out is not None else y
    x2 = as_rows(x)
    result = out if out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = rows_view(result)
    if out2 is None:  # caller's out has unmergeable leading strides: compute into a temporary
        tmp = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        _launch(x2, None, weight, tmp, None, float(eps), variant)
        return result.copy_(tmp.view(x.shape))
    _launch(x2, None, weight, out2, None, float(eps), variant)
    return result


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, variant: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; the sum is rounded to x's dtype. `variant` as in
    rms_norm."""
    _validate(x, weight, eps, residual, variant)
    if not use_triton(x):
        return _rms_norm_cpu(x, weight, eps, residual)
    x2, r2 = as_rows(x), as_rows(residual)
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x2, r2, weight, normed.view(-1, x.shape[-1]), new_residual.view(-1, x.shape[-1]), float(eps),
            variant)
    return normed, new_residual


# --------------------------------------------------------------------------------------------- AOT specs
def compile_specs():
    """Specialisations compiled for sm_80/89/90 by the compile tests and tools/inspect_triton.py."""
    from kernel_lab.harness.compile import CompileSpec

    specs = []
    base = {"H": "i32", "x_row_stride": "i32", "res_row_stride": "i32", "out_row_stride": "i32",
            "res_out_row_stride": "i32", "eps": "fp32"}
    aligned = ("H", "x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr", "x_row_stride", "res_row_stride",
               "out_row_stride", "res_out_row_stride")
    for dtype, ty, H, residual in [("bf16", "*bf16", 4096, False), ("fp16", "*fp16", 8192, True),
                                   ("fp32", "*fp32", 1024, False), ("bf16", "*bf16", 16384, False)]:
        looped, block, warps = launch_config(H)
        sig = {"x_ptr": ty, "res_ptr": ty, "w_ptr": ty, "out_ptr": ty, "res_out_ptr": ty, **base}
        specs.append(CompileSpec(
            name=f"rms_norm_row_{dtype}_h{H}" + ("_residual" if residual else ""), kernel=_rms_norm_row_kernel,
            signature=sig, constexprs={"BLOCK": block, "HAS_RESIDUAL": residual}, num_warps=warps, aligned=aligned,
        ))
    for dtype, ty, H, residual in [("bf16", "*bf16", 8192, False), ("fp16", "*fp16", 8192, True),
                                   ("fp32", "*fp32", 4096, False), ("bf16", "*bf16", MULTIROW_MAX_H, True)]:
        block, warps, _ = launch_config_multirow(8192, H)
        sig = {"x_ptr": ty, "res_ptr": ty, "w_ptr": ty, "out_ptr": ty, "res_out_ptr": ty, "rows": "i32", **base,
               "ROWS_PER_PROGRAM": "i32"}
        specs.append(CompileSpec(
            name=f"rms_norm_multirow_{dtype}_h{H}" + ("_residual" if residual else ""),
            kernel=_rms_norm_multirow_kernel, signature={n: sig[n] for n in _rms_norm_multirow_kernel.arg_names
                                                         if n in sig},
            constexprs={"BLOCK": block, "HAS_RESIDUAL": residual}, num_warps=warps, aligned=aligned,
        ))
    for residual in (False, True):
        sig = {name: "*bf16" for name in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")} | base
        specs.append(CompileSpec(
            name="rms_norm_looped_bf16" + ("_residual" if residual else ""), kernel=_rms_norm_looped_kernel,
            signature=sig, constexprs={"CHUNK": LOOP_CHUNK, "HAS_RESIDUAL": residual}, num_warps=8, aligned=aligned,
        ))
    return specs
