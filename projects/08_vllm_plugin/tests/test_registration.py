"""Step 1: after vLLM loads its general plugins, every SiluAndMul vLLM builds is the replacement, and the
`custom_ops` setting decides, under the name "SiluAndMul", whether it runs the kernel (forward_cpu) or
the native math that torch.compile traces (forward_native)."""

import logging

import kernel_lab_vllm_plugin
import pytest
import torch
from kernel_lab_vllm_plugin.layer import KernelLabSiluAndMul
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.config.compilation import CompilationMode
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.plugins import load_general_plugins

from kernel_lab.harness.testing import assert_close, randn

EAGER = CompilationMode.NONE  # what enforce_eager=True selects
COMPILED = CompilationMode.DYNAMO_TRACE_ONCE  # what the CPU platform selects for torch.compile


@pytest.fixture(scope="module", autouse=True)
def plugins_loaded():
    load_general_plugins()
    assert kernel_lab_vllm_plugin.is_registered()


# (mode, custom_ops, enabled). None = vLLM's default: "all" in eager mode, "none" under Inductor.
SETTINGS = [
    (EAGER, None, True),
    (EAGER, ["-SiluAndMul"], False),
    (EAGER, ["none"], False),
    (EAGER, ["none", "+SiluAndMul"], True),
    (COMPILED, None, False),
    (COMPILED, ["+SiluAndMul"], True),
    (COMPILED, ["all"], True),
    (COMPILED, ["all", "-SiluAndMul"], False),
    # The stock op's name no longer reaches the replacement (register_oot renamed it): no effect.
    (COMPILED, ["+silu_and_mul"], False),
    (EAGER, ["-silu_and_mul"], True),
]


@pytest.mark.parametrize("mode,custom_ops,enabled", SETTINGS,
                         ids=[f"{m.name}-{','.join(c) if c else 'default'}" for m, c, _ in SETTINGS])
def test_replacement_under_custom_ops_setting(mode, custom_ops, enabled):
    kwargs = {"mode": mode}
    if custom_ops is not None:
        kwargs["custom_ops"] = list(custom_ops)
    config = VllmConfig(compilation_config=CompilationConfig(**kwargs))
    with set_current_vllm_config(config):
        layer = SiluAndMul()  # what vLLM's Llama MLP constructs
        assert type(layer) is KernelLabSiluAndMul
        assert type(layer).name == "SiluAndMul"
        assert layer.enabled() is enabled
        expected = KernelLabSiluAndMul.forward_cpu if enabled else KernelLabSiluAndMul.forward_native
        method = layer._forward_method
        # A disabled op's forward_native is wrapped in torch.compile when compilation is on.
        assert (hasattr(method, "_torchdynamo_orig_callable")) is (mode != EAGER and not enabled)
        method = getattr(method, "_torchdynamo_orig_callable", method)
        assert method.__func__ is expected
        compilation = config.compilation_config
        assert ("SiluAndMul" in compilation.enabled_custom_ops) is enabled
        assert ("SiluAndMul" in compilation.disabled_custom_ops) is not enabled
        x = randn((5, 2 * 96), torch.float32, "cpu", 3, scale=3.0)
        gate, up = x[:, :96].double(), x[:, 96:].double()
        assert_close(layer(x), gate * torch.sigmoid(gate) * up, torch.float32)


def test_register_is_idempotent():
    before = dict(op_registry_oot)
    for _ in range(3):
        kernel_lab_vllm_plugin.register()
    assert op_registry_oot == before


@pytest.fixture
def registry_entry_removed():
    """Takes the plugin's entry out of vLLM's registry for one test and puts it back afterwards."""
    saved = op_registry_oot.pop("SiluAndMul")
    yield
    op_registry_oot["SiluAndMul"] = saved


def test_registration_logs_once(registry_entry_removed):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    plugin_logger = logging.getLogger("vllm.plugins.kernel_lab")
    plugin_logger.addHandler(handler)
    level = plugin_logger.level
    plugin_logger.setLevel(logging.INFO)
    try:
        for _ in range(3):
            kernel_lab_vllm_plugin.register()
    finally:
        plugin_logger.removeHandler(handler)
        plugin_logger.setLevel(level)
    assert op_registry_oot["SiluAndMul"] is KernelLabSiluAndMul
    assert len(records) == 1, [r.getMessage() for r in records]
    assert "+SiluAndMul" in records[0].getMessage()


def test_registration_refuses_a_second_replacement(registry_entry_removed):
    class OtherSiluAndMul(SiluAndMul):
        pass

    op_registry_oot["SiluAndMul"] = OtherSiluAndMul
    try:
        with pytest.raises(RuntimeError, match="already replaced by .*OtherSiluAndMul"):
            kernel_lab_vllm_plugin.register()
    finally:
        op_registry_oot.pop("SiluAndMul")


def test_layer_construction_reports_once_whether_the_kernel_runs(monkeypatch):
    from kernel_lab_vllm_plugin import layer as layer_module

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    plugin_logger = logging.getLogger("vllm.plugins.kernel_lab")
    monkeypatch.setattr(layer_module, "_announced", False)
    level = plugin_logger.level
    plugin_logger.setLevel(logging.INFO)
    plugin_logger.addHandler(handler)
    try:
        with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(mode=COMPILED))):
            for _ in range(3):  # one per decoder layer in a real model
                SiluAndMul()
    finally:
        plugin_logger.removeHandler(handler)
        plugin_logger.setLevel(level)
    assert len(records) == 1, [r.getMessage() for r in records]
    assert "disabled by custom_ops" in records[0].getMessage() and "'+SiluAndMul'" in records[0].getMessage()
