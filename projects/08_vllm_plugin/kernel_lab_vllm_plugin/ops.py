"""`torch.ops.kernel_lab.silu_and_mul`: project 02's SwiGLU kernel as a PyTorch operator.

Why a `triton_op` and not a plain Python call: vLLM runs the model under torch.compile. A raw Triton
launch inside a compiled region would break the graph (Dynamo cannot trace a launch on fake tensors),
and a `custom_op` would be opaque to Inductor. `triton_op` registers an operator whose body Inductor
decomposes during AOT tracing: on CUDA it sees the user Triton kernel through `wrap_triton` and calls it
from the generated code; on CPU the body is plain aten math that Inductor fuses like any other.

Outside a compiled region the dispatcher runs the device kernels registered below, which call the
public op `kernel_lab.ops.silu_and_mul` (its validation, its dispatch rule: GPU kernel on CUDA, the PyTorch
reference on CPU, or the Triton kernel through the interpreter when TRITON_INTERPRET=1).

Nothing here is a copy of the kernel: the kernel, its launch configuration and its reference all come
from `kernel_lab.ops.swiglu`.
"""

from __future__ import annotations

import torch
import triton
from torch.library import triton_op, wrap_triton

import kernel_lab.ops as kernel_lab_ops
from kernel_lab.ops import swiglu

OP_NAMESPACE = "kernel_lab"
OP_NAME = f"{OP_NAMESPACE}::silu_and_mul"

# The JIT function itself, so that Inductor can read its source when it inlines the launch.
_gated_activation_kernel = swiglu._gated_activation_kernel


def launch_traceable(x: torch.Tensor, out: torch.Tensor) -> None:
    """Launch project 02's kernel through `wrap_triton`, so the launch is traceable.

    x: [..., 2*d] unit stride in the last dim; out: [..., d] contiguous. Follows the launch contract of
    `swiglu._launch` (grid = (rows, column blocks), `swiglu.launch_config`), which the CPU test suite
    checks through the interpreter. Rows are not tested against zero: a symbolic row count must not be
    specialised, and Triton launches nothing for an empty grid.
    """
    d = out.shape[-1]
    x2 = x.reshape(-1, x.shape[-1])
    out2 = out.view(-1, d)
    block, num_warps = swiglu.launch_config(d, x.element_size())
    col_blocks = triton.cdiv(d, block)
    if col_blocks > swiglu.MAX_GRID_Y:
        raise ValueError(f"x's half width d={d} exceeds the supported maximum {swiglu.MAX_GRID_Y * block}")
    wrap_triton(_gated_activation_kernel)[(x2.shape[0], col_blocks)](
        x2, out2, d, x2.stride(0), out2.stride(0), BLOCK=block, ACTIVATION="silu", num_warps=num_warps,
    )


@triton_op(OP_NAME, mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:]; what torch.compile traces (and the fake implementation)."""
    if x.device.type != "cuda":
        # Inductor cannot launch user Triton kernels on CPU tensors; on CPU it sees the reference math,
        # which is the kernel's numerical contract (fp32 compute, one rounding).
        return swiglu.silu_and_mul_reference(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
    launch_traceable(x, out)
    return out


def _eager_kernel(x: torch.Tensor) -> torch.Tensor:
    # Attribute lookup at call time: the public op, whatever `kernel_lab.ops.silu_and_mul` is right now.
    return kernel_lab_ops.silu_and_mul(x)


silu_and_mul.register_kernel("cpu")(_eager_kernel)
silu_and_mul.register_kernel("cuda")(_eager_kernel)
