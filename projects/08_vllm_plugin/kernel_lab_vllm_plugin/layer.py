"""The replacement `SiluAndMul` layer. Importing this module imports vLLM."""

from __future__ import annotations

import logging

import torch
from vllm.model_executor.layers.activation import SiluAndMul

from kernel_lab.ops import swiglu

from . import ops  # noqa: F401  (registers torch.ops.kernel_lab.silu_and_mul)

logger = logging.getLogger("vllm.plugins.kernel_lab")
_announced = False


class KernelLabSiluAndMul(SiluAndMul):
    """vLLM's SiluAndMul with kernel_lab's SwiGLU kernel as the custom-op implementation.

    vLLM picks one forward at construction: an enabled custom op runs the platform's method
    (forward_cuda / forward_hip / forward_cpu), a disabled one runs forward_native, which torch.compile
    traces. Both enabled paths go through `torch.ops.kernel_lab.silu_and_mul`, so torch.compile sees the
    Triton kernel on a GPU. The disabled path is kernel_lab's reference, the kernel's own numerical
    contract (fp32 math, one rounding), so enabling the op changes speed, not numbers.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _announce_once(self._enforce_enable or self.enabled())

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


def _announce_once(enabled: bool) -> None:
    """One line per process when the model is built (vLLM's logging is configured by then, unlike at plugin
    load in the front-end process), saying whether the kernel will run: in compiled mode it is off unless
    custom_ops names it."""
    global _announced
    if _announced:
        return
    _announced = True
    if enabled:
        logger.info("kernel_lab_vllm_plugin: SiluAndMul layers run kernel_lab.ops.silu_and_mul (custom op enabled)")
    else:
        logger.info("kernel_lab_vllm_plugin: SiluAndMul is disabled by custom_ops and runs the native reference; "
                    "add '+SiluAndMul' to custom_ops to run the kernel")
