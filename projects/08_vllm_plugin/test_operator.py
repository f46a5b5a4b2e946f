"""Project 08 on a GPU: the plugin's operator against vLLM's own CUDA `silu_and_mul`.

Needs CUDA and vLLM (any CUDA machine with `pip install vllm`; the plugin need not be installed, this
directory is put on the path). Without vLLM the module is skipped; without CUDA every test is skipped.

    python -m pytest -m gpu projects/08_vllm_plugin/test_operator.py
"""

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_lab_vllm_plugin import ops  # noqa: E402, F401  (registers torch.ops.kernel_lab.silu_and_mul)

from kernel_lab.harness.testing import assert_close, case_seed, randn  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Intermediate sizes of real models (SmolLM2-135M, Qwen2.5-1.5B, Llama-2-7B, Llama-3-8B) and an odd one.
WIDTHS = [1536, 8960, 11008, 14336, 4097]
TOKENS = [1, 7, 256, 4096]


def reference64(x):
    d = x.shape[-1] // 2
    gate, up = x[..., :d].double(), x[..., d:].double()
    return gate * torch.sigmoid(gate) * up


def vllm_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

    out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
    torch.ops._C.silu_and_mul(out, x)
    return out


def _ulp_tolerance(dtype: torch.dtype) -> float:
    # vLLM rounds silu(gate) to the activation dtype before multiplying; kernel_lab rounds once at the end.
    # The two may differ by a couple of units in the last place, never more.
    return {torch.float16: 2 * 2.0**-10, torch.bfloat16: 2 * 2.0**-7, torch.float32: 4 * 2.0**-23}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_operator_matches_vllm_cuda_kernel(tokens, d, dtype):
    x = randn((tokens, 2 * d), dtype, "cuda", case_seed("vllm-op", tokens, d, dtype), scale=3.0)
    ours = torch.ops.kernel_lab.silu_and_mul(x)
    theirs = vllm_silu_and_mul(x)
    exact = reference64(x)
    assert_close(ours, exact, dtype)
    assert_close(theirs, exact, dtype, msg="vLLM's own kernel (sanity check of the comparison)")
    rel = ((ours.double() - theirs.double()).abs() / exact.abs().clamp_min(1e-3)).max().item()
    assert rel <= _ulp_tolerance(dtype), f"plugin and vLLM differ by {rel:.2e} relative"


def test_three_dimensional_input():
    x = randn((2, 5, 2 * 1536), torch.bfloat16, "cuda", 7, scale=3.0)
    assert_close(torch.ops.kernel_lab.silu_and_mul(x), reference64(x), torch.bfloat16)


def test_layer_forward_cuda_runs_the_plugin_operator():
    import kernel_lab_vllm_plugin
    from kernel_lab_vllm_plugin.layer import KernelLabSiluAndMul
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul

    kernel_lab_vllm_plugin.register()
    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=["none", "+SiluAndMul"]))
    with set_current_vllm_config(config):
        layer = SiluAndMul()
    assert type(layer) is KernelLabSiluAndMul
    assert layer._forward_method.__func__ is KernelLabSiluAndMul.forward_cuda
    x = randn((33, 2 * 11008), torch.bfloat16, "cuda", 3, scale=3.0)
    assert_close(layer(x), reference64(x), torch.bfloat16)


def test_torch_compile_inlines_the_triton_kernel():
    """What vLLM's compiled mode does with the enabled op: Inductor's generated code launches project 02's
    kernel itself (no call back into the eager operator)."""
    from torch._inductor.utils import run_and_get_code

    def mlp_tail(x):
        return torch.ops.kernel_lab.silu_and_mul(x) * 0.5

    compiled = torch.compile(mlp_tail, fullgraph=True, dynamic=True)
    x = randn((40, 2 * 1536), torch.float16, "cuda", 5, scale=3.0)
    y, code = run_and_get_code(compiled, x)
    assert_close(y, reference64(x) * 0.5, torch.float16)
    source = "\n".join(code)
    assert "_gated_activation_kernel" in source
    assert "torch.ops.kernel_lab.silu_and_mul" not in source, "the operator was kept opaque, not inlined"


def test_cuda_graph_capture_and_replay():
    """vLLM replays decode steps from CUDA graphs: the eager operator must capture (no host sync)."""
    x = randn((8, 2 * 8960), torch.bfloat16, "cuda", 9, scale=3.0)
    torch.ops.kernel_lab.silu_and_mul(x)  # compile the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.kernel_lab.silu_and_mul(x)
    x.copy_(randn(x.shape, torch.bfloat16, "cuda", 10, scale=3.0))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(y, reference64(x), torch.bfloat16)
