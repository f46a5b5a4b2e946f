"""The replacement `SiluAndMul` layer. Importing this module imports vLLM."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.activation import SiluAndMul

from kernel_lab.ops import swiglu

from . import ops  # noqa: F401  (registers torch.ops.kernel_lab.silu_and_mul)


class KernelLabSiluAndMul(SiluAndMul):
    """vLLM's SiluAndMul with kernel_lab's SwiGLU kernel as the custom-op implementation.

    vLLM picks one forward at construction: an enabled custom op runs the platform's method
    (forward_cuda / forward_hip / forward_cpu), a disabled one runs forward_native, which torch.compile
    traces. Both enabled paths go through `torch.ops.kernel_lab.silu_and_mul`, so torch.compile sees the
    Triton kernel on a GPU. The disabled path is kernel_lab's reference, the kernel's own numerical
    contract (fp32 math, one rounding), so enabling the op changes speed, not numbers.
    """

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu.silu_and_mul_reference(x)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kernel_lab.silu_and_mul(x)

    def forward_hip(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kernel_lab.silu_and_mul(x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kernel_lab.silu_and_mul(x)

    def forward_xpu(self, x: torch.Tensor) -> torch.Tensor:
        # The stock XPU path calls vLLM's compiled _C op; kernel_lab has no XPU kernel.
        return self.forward_native(x)
