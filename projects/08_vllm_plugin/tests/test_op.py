"""`torch.ops.kernel_lab.silu_and_mul`: eager numerics, the traceable launch, torch.compile on CPU.

Under the repository conftest (no CUDA) TRITON_INTERPRET=1, so the eager op and `launch_traceable` run
project 02's Triton kernel through the interpreter; the `reference_only` cases take the PyTorch path.
"""

import pytest
import torch
from kernel_lab_vllm_plugin import ops

from kernel_lab.harness.testing import assert_close, case_seed, empty_poisoned, randn
from kernel_lab.ops import swiglu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference64(x):
    d = x.shape[-1] // 2
    gate, up = x[..., :d].double(), x[..., d:].double()
    return gate * torch.sigmoid(gate) * up


@pytest.fixture
def launches(monkeypatch):
    """Counts launches of project 02's kernel through its own launcher."""
    count = {"n": 0}
    launch = swiglu._launch

    def counting(*args, **kwargs):
        count["n"] += 1
        return launch(*args, **kwargs)

    monkeypatch.setattr(swiglu, "_launch", counting)
    return count


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2 * 37), (2, 3, 2 * 200), (3, 2 * 1536)])
def test_eager_op_runs_the_triton_kernel(shape, dtype, launches):
    x = randn(shape, dtype, "cpu", case_seed("plugin-eager", shape, dtype), scale=3.0)
    y = torch.ops.kernel_lab.silu_and_mul(x)
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == dtype
    assert launches["n"] == 1, "the eager op must go through kernel_lab.ops.silu_and_mul's Triton launch"
    assert_close(y, reference64(x), dtype)


def test_eager_op_reference_path(reference_only, launches):
    x = randn((7, 2 * 96), torch.bfloat16, "cpu", 11, scale=3.0)
    y = torch.ops.kernel_lab.silu_and_mul(x)
    assert launches["n"] == 0
    assert torch.equal(y, swiglu.silu_and_mul_reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["rows", "odd_d", "strided_rows", "three_d", "several_blocks"])
def test_traceable_launch_follows_the_kernel_contract(case, dtype):
    """`launch_traceable` re-states swiglu._launch's grid and arguments for wrap_triton; if project 02
    changes its kernel's signature or launch contract this fails on CPU, not first on a GPU."""
    seed = case_seed("traceable", case, dtype)
    if case == "rows":
        x = randn((4, 2 * 64), dtype, "cpu", seed)
    elif case == "odd_d":
        x = randn((3, 2 * 45), dtype, "cpu", seed)
    elif case == "strided_rows":
        x = randn((6, 2 * 50 + 12), dtype, "cpu", seed)[::2, 5:5 + 2 * 50]
    elif case == "three_d":
        x = randn((2, 3, 2 * 33), dtype, "cpu", seed)
    else:
        block, _ = swiglu.launch_config(5000, x_size := torch.finfo(dtype).bits // 8)
        assert 5000 > 2 * block, f"must span several column blocks (block {block}, {x_size}-byte elements)"
        x = randn((2, 2 * 5000), dtype, "cpu", seed)
    out = empty_poisoned((*x.shape[:-1], x.shape[-1] // 2), dtype, "cpu")
    ops.launch_traceable(x, out)
    assert_close(out, reference64(x), dtype)


def test_bad_input_is_rejected_naming_x():
    with pytest.raises(ValueError, match="x's last dimension must be even"):
        torch.ops.kernel_lab.silu_and_mul(torch.randn(3, 7))


def test_opcheck():
    """Schema, fake tensor and AOT-dispatch checks of the registered operator."""
    x = randn((3, 2 * 40), torch.float32, "cpu", 5)
    torch.library.opcheck(torch.ops.kernel_lab.silu_and_mul.default, (x,))


def test_torch_compile_traces_the_op_on_cpu(launches):
    """What vLLM's compiled mode does with the enabled op: Dynamo keeps it as one node, AOT tracing
    decomposes the triton_op body (CPU: the reference math), Inductor compiles it; no eager launch."""
    graphs = []

    def inductor_recording(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        graphs.append(str(gm.graph))
        return compile_fx(gm, example_inputs)

    def mlp_tail(x):
        return torch.ops.kernel_lab.silu_and_mul(x) * 0.5

    compiled = torch.compile(mlp_tail, backend=inductor_recording, fullgraph=True, dynamic=True)
    for rows in (5, 9):
        x = randn((rows, 2 * 48), torch.float32, "cpu", case_seed("compile", rows), scale=3.0)
        assert_close(compiled(x), reference64(x) * 0.5, torch.float32)
    assert len(graphs) == 1, "one dynamic-shape graph expected"
    assert "kernel_lab.silu_and_mul" in graphs[0]
    assert launches["n"] == 0, "compiled code must not call back into the eager kernel"
