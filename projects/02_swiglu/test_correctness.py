"""Project 02 correctness: silu_and_mul and gelu_and_mul (exact and tanh) vs independent float64 formulations.

On a machine without CUDA these run the Triton kernel through the interpreter (see conftest.py); on a
GPU they run the compiled kernel. Grids stay at a few hundred programs so the interpreter is quick.
"""

import math
import re

import pytest
import torch

from kernel_lab.harness.compile import TARGETS, check_no_spills, compile_module
from kernel_lab.harness.testing import assert_close, case_seed, poison, randn
from kernel_lab.ops import gelu_and_mul, silu_and_mul
from kernel_lab.ops import swiglu as swiglu_module
from kernel_lab.ops.swiglu import bytes_moved, launch_config

# The interpreter's numpy exp warns where exp(-z) overflows to inf, the intended limit (see the kernel).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _gelu_tanh64(g):  # written out from the formula, not torch's gelu(approximate="tanh")
    return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))


# activation -> (the public op, the activation in float64)
ACTIVATIONS = {
    "silu": (silu_and_mul, lambda g: g * torch.sigmoid(g)),
    "gelu": (lambda x, out=None: gelu_and_mul(x, out=out), lambda g: 0.5 * g * (1.0 + torch.erf(g / math.sqrt(2.0)))),
    "gelu_tanh": (lambda x, out=None: gelu_and_mul(x, out=out, approximate="tanh"), _gelu_tanh64),
}


@pytest.fixture(params=list(ACTIVATIONS))
def act(request):
    """(op, reference64) for each gated activation: every test below runs for each."""
    op, activation64 = ACTIVATIONS[request.param]

    def reference64(x):
        d = x.shape[-1] // 2
        gate, up = x[..., :d].double(), x[..., d:].double()
        return activation64(gate) * up

    return op, reference64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (3, 14), (5, 254), (2, 3, 2000), (1, 2 * 3001), (4, 2 * 1536)])
def test_matches_float64(act, shape, dtype, device):
    op, reference64 = act
    x = randn(shape, dtype, device, case_seed("swiglu", shape, dtype), scale=3.0)
    out = poison(torch.empty((*shape[:-1], shape[-1] // 2), dtype=dtype, device=device))
    y = op(x, out=out)
    assert y.data_ptr() == out.data_ptr() and y.dtype == dtype and y.shape == out.shape
    assert_close(y, reference64(x), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_half_width_spans_several_column_blocks(act, dtype, device):
    op, reference64 = act
    block, _ = launch_config(5000, torch.finfo(dtype).bits // 8)
    assert 5000 > 2 * block, "the case must exercise several column blocks and a ragged last block"
    x = randn((2, 2 * 5000), dtype, device, case_seed("blocks", dtype))
    assert_close(op(x), reference64(x), dtype)


def test_one_dimensional_input(act, device):
    op, reference64 = act
    x = randn((2 * 77,), torch.float16, device, 3)
    y = op(x)
    assert y.shape == (77,)
    assert_close(y, reference64(x), torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_strided_out(act, dtype, device):
    op, reference64 = act
    d = 129
    base = randn((6, 4, 2 * d + 40), dtype, device, case_seed("strided", dtype))
    x = base[::2, :, 17:17 + 2 * d]  # leading dims and rows strided, last dim unit stride
    out_base = poison(torch.empty((3, 4, d + 9), dtype=dtype, device=device))
    out = out_base[:, :, 5:5 + d]
    op(x, out=out)
    assert_close(out, reference64(x), dtype)
    outside = torch.cat([out_base[:, :, :5], out_base[:, :, 5 + d:]], dim=-1)
    assert torch.isnan(outside.float()).all(), "kernel wrote outside `out`"


def test_unmergeable_leading_dims_and_transposed_last_dim(act, device):
    op, reference64 = act
    dtype = torch.bfloat16
    # [4, 3, 2d] viewed as [3, 4, 2d]: leading dims cannot be merged into one row stride
    x = randn((4, 3, 2 * 40), dtype, device, 21).transpose(0, 1)
    out = poison(torch.empty((4, 3, 40), dtype=dtype, device=device)).transpose(0, 1)
    op(x, out=out)
    assert_close(out, reference64(x), dtype)
    # a non-unit last-dim stride is accepted (copied), not misread
    xt = randn((2 * 33, 5), dtype, device, 22).t()
    assert_close(op(xt), reference64(xt), dtype)


def test_large_magnitudes_give_no_nan(act, device):
    op, reference64 = act
    gate = torch.tensor([[-1000.0, -200.0, -88.5, -20.0, 0.0, 20.0, 88.5, 1000.0]])
    up = torch.tensor([[3.0, -2.0, 1.5, 0.5, 7.0, -1.0, 2.0, 1e-3]])
    x = torch.cat([gate, up], dim=-1).to(device)
    y = op(x)
    assert torch.isfinite(y).all(), y
    assert_close(y, reference64(x), torch.float32)


def test_zero_tokens(act, device):
    op, _ = act
    for shape in [(0, 64), (2, 0, 64)]:
        x = torch.empty(shape, dtype=torch.float16, device=device)
        y = op(x)
        assert y.shape == (*shape[:-1], 32) and y.dtype == torch.float16


def test_inputs_are_not_modified(act, device):
    op, _ = act
    x = randn((3, 2 * 100), torch.bfloat16, device, 8)
    op(x)
    assert torch.equal(x.cpu(), randn((3, 2 * 100), torch.bfloat16, "cpu", 8))


@pytest.fixture
def c_path(c_kernels_only):
    """float32 on the CPU through csrc/cpu/norm_activation.c, with the reference made to fail."""
    c_kernels_only(swiglu_module, "gated_activation_reference")


@pytest.mark.parametrize("shape", [(1, 2), (3, 2 * 7), (5, 2 * 1536), (2, 3, 2 * 4097)])
def test_c_cpu_path_matches_float64(act, c_path, shape):
    op, reference64 = act
    seed = case_seed("swiglu-c", shape)
    x = randn((*shape[:-1], shape[-1] + 5), torch.float32, "cpu", seed, scale=4.0)[..., 2:2 + shape[-1]]
    d = shape[-1] // 2
    out_base = poison(torch.empty((*shape[:-1], d + 4)))
    out = out_base[..., 1:1 + d]
    assert op(x, out=out).data_ptr() == out.data_ptr()
    assert_close(out, reference64(x), torch.float32)
    assert torch.isnan(out_base[..., :1]).all() and torch.isnan(out_base[..., 1 + d:]).all()
    assert_close(op(x), reference64(x), torch.float32)


def test_c_cpu_path_large_magnitudes(act, c_path):
    op, reference64 = act
    gate = torch.tensor([[-1000.0, -200.0, -88.5, -87.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.5, 1000.0]])
    up = torch.tensor([[3.0, -2.0, 1.5, 0.25, 0.5, 4.0, 7.0, -3.0, -1.0, 2.0, 1e-3]])
    y = op(torch.cat([gate, up], dim=-1))
    assert torch.isfinite(y).all(), y
    assert_close(y, reference64(torch.cat([gate, up], dim=-1)), torch.float32)


def test_reference_path_agrees(act, reference_only):
    op, reference64 = act
    x = randn((3, 2 * 50), torch.float32, "cpu", 4)
    assert_close(op(x), reference64(x), torch.float32)


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda d: silu_and_mul(torch.ones(2, 4, dtype=torch.int32, device=d)), TypeError,
         "x must have dtype"),
        (lambda d: silu_and_mul(torch.ones(2, 7, device=d)), ValueError, "x's last dimension must be even"),
        (lambda d: silu_and_mul(torch.ones(2, 0, device=d)), ValueError, "x's last dimension must be even"),
        (lambda d: silu_and_mul(torch.tensor(1.0, device=d)), ValueError, "x must have at least 1 dimension"),
        (lambda d: silu_and_mul([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
        (lambda d: silu_and_mul(torch.ones(2, 8, device=d), out=torch.empty(2, 8, device=d)), ValueError,
         "out must have shape"),
        (lambda d: silu_and_mul(torch.ones(2, 8, device=d), out=torch.ones(2, 4, device=d).half()),
         TypeError, "out must have dtype"),
        (lambda d: silu_and_mul(torch.ones(2, 8, device=d), out=torch.empty(4, 2, device=d).t()), ValueError,
         "out must be contiguous in its last dimension"),
        (lambda d: (lambda x: silu_and_mul(x, out=x[:, 2:6]))(torch.ones(2, 8, device=d)), ValueError,
         "out must not overlap x"),
        (lambda d: silu_and_mul(torch.ones(2, 8, device=d), out="buffer"), TypeError,
         "out must be a torch.Tensor"),
        (lambda d: gelu_and_mul(torch.ones(2, 8, device=d), approximate="erf"), ValueError,
         "approximate must be one of"),
        (lambda d: gelu_and_mul(torch.ones(2, 7, device=d), approximate="tanh"), ValueError,
         "x's last dimension must be even"),
    ],
)
def test_bad_input_is_rejected_with_a_named_argument(call, error, pattern, device):
    with pytest.raises(error, match=pattern):
        call(device)


def test_mixed_devices_rejected():
    if not torch.cuda.is_available():
        pytest.skip("needs two devices")  # pragma: no cover
    with pytest.raises(ValueError, match="share a device"):
        silu_and_mul(torch.ones(2, 8, device="cuda"), out=torch.empty(2, 4))


# --- generated code -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled():
    return compile_module("kernel_lab.ops.swiglu", targets=TARGETS)


def test_compiles_for_every_target_without_spills(compiled):
    assert len(check_no_spills(compiled, max_registers=64)) >= 5


def test_sass_uses_128_bit_global_accesses(compiled):
    aligned = [(k, v) for k, v in compiled.items() if "odd" not in k[0]]
    assert len(aligned) >= 12
    for (name, target), result in aligned:
        loads = set(re.findall(r"LDG\.E[A-Z0-9.]*", result["sass"]))
        stores = set(re.findall(r"STG\.E[A-Z0-9.]*", result["sass"]))
        assert loads and all(op.endswith(".128") for op in loads), (name, target, loads)
        assert stores and all(op.endswith(".128") for op in stores), (name, target, stores)


def test_sass_exponential_is_the_fast_path(compiled):
    # tl.exp lowers to ex2.approx (MUFU.EX2): one SFU op per element, not a libm call
    for (name, target), result in compiled.items():
        assert "MUFU.EX2" in result["sass"], (name, target)
        assert "CALL" not in result["sass"], (name, target)


# --- GPU-only checks -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, d", [(1, 14336), (7, 1536), (4096, 11008), (333, 18944), (1000, 8960 + 8),
                                       (64, 4097), (32768, 1536)])
def test_gpu_model_shapes(act, tokens, d, dtype):
    op, reference64 = act
    x = randn((tokens, 2 * d), dtype, "cuda", case_seed("gpu", tokens, d, dtype), scale=3.0)
    out = poison(torch.empty((tokens, d), dtype=dtype, device="cuda"))
    op(x, out=out)
    assert_close(out, reference64(x), dtype)


@pytest.mark.gpu
def test_gpu_beyond_int32_offsets(act):
    op, reference64 = act
    tokens, d = 131072 + 8, 8192  # x holds > 2^31 elements
    x = torch.empty((tokens, 2 * d), dtype=torch.bfloat16, device="cuda")
    assert x.numel() > 2**31
    tail = randn((8, 2 * d), torch.bfloat16, "cuda", 17)
    x[-8:].copy_(tail)
    y = op(x)
    assert_close(y[-8:], reference64(tail), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_matches_the_dispatch_reference_closely():
    # vs the fp32 PyTorch reference: identical math, so at most one rounding step apart
    from kernel_lab.ops.swiglu import silu_and_mul_reference

    x = randn((256, 2 * 4096), torch.float16, "cuda", 3, scale=4.0)
    diff = (silu_and_mul(x).double() - silu_and_mul_reference(x).double()).abs()
    ulp = silu_and_mul_reference(x).double().abs() * 2.0**-10
    assert bool((diff <= ulp + 1e-7).all())


@pytest.mark.gpu
def test_gpu_under_cuda_graph(act):
    op, reference64 = act
    x = randn((16, 2 * 14336), torch.bfloat16, "cuda", 5)
    out = torch.empty((16, 14336), dtype=torch.bfloat16, device="cuda")
    op(x, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(x, out=out)
    x.copy_(randn((16, 2 * 14336), torch.bfloat16, "cuda", 9))
    poison(out)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference64(x), torch.bfloat16)


def test_bytes_moved_is_one_read_of_x_and_one_write_of_out():
    assert bytes_moved(32768, 14336, 2) == 32768 * 2 * 14336 * 2 + 32768 * 14336 * 2
