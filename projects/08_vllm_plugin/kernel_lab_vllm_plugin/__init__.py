"""kernel_lab's vLLM plugin: replaces vLLM's `SiluAndMul` with project 02's SwiGLU Triton kernel.

vLLM calls `register()` in every process it starts (entry point group `vllm.general_plugins`). Users
enable the op like any vLLM custom op, under the name the replacement is registered with:

    LLM(model, compilation_config={"custom_ops": ["+SiluAndMul"]})     # compiled mode (off by default)
    LLM(model, enforce_eager=True)                                     # eager: custom ops are on

`register_oot` renames the op to the class name "SiluAndMul", so "+silu_and_mul" (the stock name) no
longer reaches it once the plugin is loaded.
"""

from __future__ import annotations

import logging

TARGET_VLLM_VERSION = "0.32.0"
REPLACED_OP = "SiluAndMul"  # the registry key and the name users write in custom_ops

# Under the "vllm" logger, so the message uses vLLM's handler, format and VLLM_LOGGING_LEVEL.
logger = logging.getLogger("vllm.plugins.kernel_lab")


def register() -> None:
    """Register the replacement once per process; later calls do nothing. Raises if another plugin
    already replaced SiluAndMul (vLLM would keep whichever registered first without saying so)."""
    import vllm
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.activation import SiluAndMul

    from .layer import KernelLabSiluAndMul

    current = op_registry_oot.get(REPLACED_OP)
    if current is KernelLabSiluAndMul:
        return
    if current is not None:
        raise RuntimeError(f"{REPLACED_OP} is already replaced by {current.__module__}.{current.__qualname__}; "
                           "remove one of the plugins or select one with VLLM_PLUGINS")
    SiluAndMul.register_oot(KernelLabSiluAndMul, name=REPLACED_OP)
    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(TARGET_VLLM_VERSION):
        logger.warning("kernel_lab_vllm_plugin targets vLLM %s, found %s", TARGET_VLLM_VERSION, version)
    # vLLM may load plugins before it configures logging (LLM() does), so this line can be silent in the
    # front-end process; the layer also reports once per process, when the model is built.
    logger.info("kernel_lab_vllm_plugin: registered for %s; in compiled mode enable it with custom_ops=['+%s']",
                REPLACED_OP, REPLACED_OP)


def is_registered() -> bool:
    from vllm.model_executor.custom_op import op_registry_oot

    from .layer import KernelLabSiluAndMul

    return op_registry_oot.get(REPLACED_OP) is KernelLabSiluAndMul
