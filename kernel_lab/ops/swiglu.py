"""Project 02: gated activations in the serving layout (SwiGLU, and GeGLU for Gemma).

    x = [gate | up]  (last dimension 2*d)      ->      y = act(gate) * up  (last dimension d)
    silu(g)      = g * sigmoid(g) = g / (1 + exp(-g))                      silu_and_mul
    gelu(g)      = g/2 * (1 + erf(g / sqrt(2)))                             gelu_and_mul(approximate="none")
    gelu_tanh(g) = g/2 * (1 + tanh(u)) = g * sigmoid(2u),                   gelu_and_mul(approximate="tanh")
                   u = sqrt(2/pi) * (g + 0.044715 g^3)                      (torch's / HF's gelu_pytorch_tanh)
    all computed in fp32 and rounded once to x's dtype.

Why the halves arrive concatenated, the memory traffic and the kernel design: projects/02_swiglu/README.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cpu_kernels
from .common import (
    FLOAT_DTYPES,
    check_last_dim_contiguous,
    check_same_device,
    check_tensor,
    rows_view,
    use_triton,
)

VECTORS_PER_THREAD = 2  # 16-byte vectors of each half per thread: more loads in flight per thread
MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension (column blocks)


# activation name -> torch's fp32 form (the references) ; the names are the kernel's ACTIVATION constexpr
ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh"),
}
GELU_APPROXIMATIONS = {"none": "gelu", "tanh": "gelu_tanh"}  # torch.nn.functional.gelu's `approximate`


# --------------------------------------------------------------------------------------------- reference
def gated_activation_reference(x: torch.Tensor, activation: str) -> torch.Tensor:
    """fp32 math, one rounding to x's dtype: the numerical contract the kernel follows."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d].float(), x[..., d:].float()
    return (ACTIVATIONS[activation](gate) * up).to(x.dtype)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    return gated_activation_reference(x, "silu")


# --------------------------------------------------------------------------------------------- kernel
@triton.jit
def _gated_activation_kernel(
    x_ptr, out_ptr,
    d, x_row_stride, out_row_stride,
    BLOCK: tl.constexpr,
    ACTIVATION: tl.constexpr,  # a key of ACTIVATIONS
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == "gelu":
        y = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    else:
        # silu(g) = g * sigmoid(g), gelu_tanh(g) = g * sigmoid(2u): exp(-z) overflows to inf for z < -88,
        # and g / inf = -0, the correct limit; no NaN is produced.
        z = gate
        if ACTIVATION == "gelu_tanh":
            z = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)  # 2 * sqrt(2 / pi) * (...)
        y = gate / (1.0 + tl.exp(-z)) * up
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def launch_config(d: int, element_size: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for a half-width of d elements.

    A block is num_warps * 32 threads * VECTORS_PER_THREAD vectors of 16 bytes; it shrinks for small d so
    a 64-wide op does not launch 4 mostly masked warps.
    """
    per_vector = 16 // element_size
    full_block = 4 * 32 * VECTORS_PER_THREAD * per_vector  # 4 warps: 2048 (16-bit) or 1024 (fp32) elements
    block = min(full_block, max(32, triton.next_power_of_2(d)))
    num_warps = max(1, block // (32 * VECTORS_PER_THREAD * per_vector))
    return block, num_warps


def bytes_moved(rows: int, d: int, element_size: int) -> int:
    """DRAM bytes of one call: the [rows, 2d] input read and the [rows, d] output written, once each."""
    return 3 * rows * d * element_size


def _launch(x2: torch.Tensor, out2: torch.Tensor, activation: str = "silu") -> None:
    rows = x2.shape[0]
    d = out2.shape[1]
    if rows == 0 or d == 0:
        return
    block, num_warps = launch_config(d, x2.element_size())
    col_blocks = triton.cdiv(d, block)
    if col_blocks > MAX_GRID_Y:
        raise ValueError(f"x's half width d={d} exceeds the supported maximum {MAX_GRID_Y * block}")
    _gated_activation_kernel[(rows, col_blocks)](
        x2, out2, d, x2.stride(0), out2.stride(0), BLOCK=block, ACTIVATION=activation, num_warps=num_warps,
    )


# --------------------------------------------------------------------------------------------- public op
def _validate(x, out):
    check_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1)
    width = x.shape[-1]
    if width == 0 or width % 2 != 0:
        raise ValueError(
            f"x's last dimension must be even and non-zero ([gate | up], 2*d), got shape {tuple(x.shape)}")
    out_shape = (*x.shape[:-1], width // 2)
    if out is not None:
        check_tensor("out", out, dtypes=(x.dtype,))
        if tuple(out.shape) != out_shape:
            raise ValueError(f"out must have shape {out_shape} (x's shape with the last dimension halved), "
                             f"got {tuple(out.shape)}")
        check_same_device(x=x, out=out)
        check_last_dim_contiguous("out", out)
        if out.numel() and x.numel() and _overlaps(x, out):
            raise ValueError("out must not overlap x's memory")
    return out_shape


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a_lo, a_hi), (b_lo, b_hi) = _byte_span(a), _byte_span(b)
    return a_lo < b_hi and b_lo < a_hi


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x [..., 2*d] in fp16/bf16/fp32; returns [..., d] in x's dtype.

    Leading dimensions may have any strides (a row view needs no copy); the last dimension must be
    unit-stride or is copied. `out`, if given, must be [..., d] of x's dtype, unit-stride in its last
    dimension, on x's device and not overlapping x.
    """
    return gated_activation(x, "silu", out)


def gelu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, approximate: str = "none") -> torch.Tensor:
    """gelu(x[..., :d]) * x[..., d:] (GeGLU), with torch.nn.functional.gelu's `approximate`: "none" is the
    exact erf form, "tanh" the tanh approximation Gemma's `gelu_pytorch_tanh` uses. Same contract as
    silu_and_mul otherwise."""
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {sorted(GELU_APPROXIMATIONS)}, got {approximate!r}")
    return gated_activation(x, GELU_APPROXIMATIONS[approximate], out)


def gated_activation(x: torch.Tensor, activation: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """activation(x[..., :d]) * x[..., d:] for `activation` in ACTIVATIONS: the one path both public ops take."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    out_shape = _validate(x, out)
    if not use_triton(x):
        if x.dtype == torch.float32:  # the C kernel (csrc/cpu/norm_activation.c), where it applies
            result = out if out is not None else torch.empty(out_shape, dtype=x.dtype)
            if cpu_kernels.gated_activation_cpu(x, result, activation):
                return result
        y = gated_activation_reference(x, activation)
        return out.copy_(y) if out is not None else y
    result = out if out is not None else torch.empty(out_shape, dtype=x.dtype, device=x.device)
    if result.numel() == 0:
        return result
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2 = rows_view(x) if x.dim() > 1 else x.view(1, -1)
    if x2 is None:  # leading dims cannot be merged into one stride
        x2 = x.reshape(-1, x.shape[-1])
    out2 = rows_view(result) if result.dim() > 1 else result.view(1, -1)
    if out2 is None:
        tmp = torch.empty((x2.shape[0], out_shape[-1]), dtype=x.dtype, device=x.device)
        _launch(x2, tmp, activation)
        return result.copy_(tmp.view(out_shape))
    _launch(x2, out2, activation)
    return result


# --------------------------------------------------------------------------------------------- AOT specs
def compile_specs():
    """Specialisations compiled for sm_80/89/90 by the compile tests: real intermediate sizes with the
    alignment the JIT would infer (aligned), and an odd d that must still compile without spills."""
    from kernel_lab.harness.compile import CompileSpec

    specs = []
    aligned = ("x_ptr", "out_ptr", "d", "x_row_stride", "out_row_stride")
    signature = {"x_ptr": None, "out_ptr": None, "d": "i32", "x_row_stride": "i32", "out_row_stride": "i32"}
    for dtype, ty, size, d in [("bf16", "*bf16", 2, 14336), ("fp16", "*fp16", 2, 11008),
                               ("fp32", "*fp32", 4, 8960), ("bf16", "*bf16", 2, 1536)]:
        block, warps = launch_config(d, size)
        specs.append(CompileSpec(
            name=f"silu_and_mul_{dtype}_d{d}", kernel=_gated_activation_kernel,
            signature={**signature, "x_ptr": ty, "out_ptr": ty},
            constexprs={"BLOCK": block, "ACTIVATION": "silu"}, num_warps=warps, aligned=aligned,
        ))
    # GeGLU at Gemma's widths: gemma-2b (16384, tanh), gemma-7b (24576, tanh), and the exact erf form
    for activation, dtype, ty, size, d in [("gelu_tanh", "bf16", "*bf16", 2, 16384),
                                           ("gelu_tanh", "fp16", "*fp16", 2, 24576),
                                           ("gelu", "bf16", "*bf16", 2, 16384), ("gelu", "fp32", "*fp32", 4, 8960)]:
        block, warps = launch_config(d, size)
        specs.append(CompileSpec(
            name=f"{activation}_and_mul_{dtype}_d{d}", kernel=_gated_activation_kernel,
            signature={**signature, "x_ptr": ty, "out_ptr": ty},
            constexprs={"BLOCK": block, "ACTIVATION": activation}, num_warps=warps, aligned=aligned,
        ))
    block, warps = launch_config(4097, 2)
    for activation in ACTIVATIONS:
        specs.append(CompileSpec(
            name=f"{activation}_and_mul_fp16_odd_d4097", kernel=_gated_activation_kernel,
            signature={**signature, "x_ptr": "*fp16", "out_ptr": "*fp16"},
            constexprs={"BLOCK": block, "ACTIVATION": activation}, num_warps=warps, aligned=("x_ptr", "out_ptr"),
        ))
    return specs
