"""Project 01 correctness: Triton RMSNorm vs an independent float64 formulation.

On a machine without CUDA these run the Triton kernels through the interpreter (see conftest.py); on a
GPU they run the compiled kernels. Grids stay at a few hundred rows so the interpreter is quick.
"""

import re

import pytest
import torch

from kernel_lab.harness.compile import TARGETS, check_no_spills, compile_module
from kernel_lab.harness.testing import assert_close, assert_rounded_equal, case_seed, poison, randn
from kernel_lab.ops import fused_add_rms_norm, rms_norm
from kernel_lab.ops import rmsnorm as rmsnorm_module
from kernel_lab.ops.rmsnorm import FUSED_MAX_H

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
VARIANTS = ["auto", "multirow"]


@pytest.fixture(params=VARIANTS)
def variant(request, monkeypatch):
    """Each kernel design; the multirow kernel is made to put up to four rows in a program even for the
    few rows these tests use, so its row loop and a partly filled last program are exercised."""
    if request.param == "multirow":
        monkeypatch.setattr(rmsnorm_module, "MULTIROW_SPREAD", 1)
    return request.param


def reference64(x, weight, eps):
    x64 = x.double()
    return x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 127), (2, 3, 1000), (4, 4096), (2, 5120 + 3)])
def test_rms_norm_matches_float64(shape, dtype, variant, device):
    seed = case_seed("rms", shape, dtype)
    x = randn(shape, dtype, device, seed, scale=3.0, offset=0.5)
    w = randn(shape[-1:], dtype, device, seed + 1, offset=1.0)
    out = poison(torch.empty_like(x))
    y = rms_norm(x, w, eps=1e-5, out=out, variant=variant)
    assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
    assert_close(y, reference64(x, w, 1e-5), dtype)


@pytest.mark.parametrize("H", [FUSED_MAX_H + 1, 65536])
def test_long_rows(H, variant, device):
    """Past FUSED_MAX_H the default takes the looped kernel; the multirow kernel keeps rows up to
    MULTIROW_MAX_H in registers and hands longer ones to the looped kernel too."""
    x = randn((3, H), torch.bfloat16, device, case_seed("long", H))
    w = randn((H,), torch.bfloat16, device, case_seed("long-w", H), offset=1.0)
    assert_close(rms_norm(x, w, variant=variant), reference64(x, w, 1e-6), torch.bfloat16)
    normed, new_res = fused_add_rms_norm(x, x.flip(0), w, variant=variant)
    assert_close(normed, reference64(new_res, w, 1e-6), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_strided_out(dtype, variant, device):
    seed = case_seed("strided", dtype)
    base = randn((6, 4, 300), dtype, device, seed)
    x = base[::2, :, 17:17 + 257]  # leading dims and rows both strided, last dim unit stride
    w = randn((257,), dtype, device, seed + 1, offset=1.0)
    out_base = poison(torch.empty((3, 4, 400), dtype=dtype, device=device))
    out = out_base[:, :, 5:5 + 257]
    rms_norm(x, w, out=out, variant=variant)
    assert_close(out, reference64(x, w, 1e-6), dtype)
    assert torch.isnan(out_base[:, :, :5].float()).all(), "kernel wrote outside `out`"
    # a non-unit last-dim stride is accepted (copied), not silently misread
    xt = randn((300, 6), dtype, device, seed + 2).t()
    assert_close(rms_norm(xt, randn((300,), dtype, device, seed + 3)), reference64(xt, randn((300,), dtype, device, seed + 3), 1e-6), dtype)


def test_weight_of_another_dtype(device):
    x = randn((3, 96), torch.bfloat16, device, 11)
    w = randn((96,), torch.float32, device, 12, offset=1.0)
    assert_close(rms_norm(x, w), reference64(x, w, 1e-6), torch.bfloat16)


def test_zero_rows(variant, device):
    x = torch.empty((0, 64), dtype=torch.float16, device=device)
    w = randn((64,), torch.float16, device, 1)
    assert rms_norm(x, w, variant=variant).shape == (0, 64)
    n, r = fused_add_rms_norm(x, x.clone(), w, variant=variant)
    assert n.shape == r.shape == (0, 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (7, 333), (3, 2048), (2, FUSED_MAX_H + 8)])
def test_fused_add_rms_norm(shape, dtype, variant, device):
    seed = case_seed("fused", shape, dtype)
    x = randn(shape, dtype, device, seed)
    res = randn(shape, dtype, device, seed + 1, scale=2.0)
    w = randn(shape[-1:], dtype, device, seed + 2, offset=1.0)
    normed, new_res = fused_add_rms_norm(x, res, w, eps=1e-6, variant=variant)
    # The new residual is the sum rounded once to the activation dtype.
    assert_rounded_equal(new_res, x.double() + res.double(), dtype)
    assert_close(normed, reference64(new_res, w, 1e-6), dtype)
    assert torch.equal(x.cpu(), randn(shape, dtype, "cpu", seed)), "inputs must not be modified"


def test_fused_with_strided_inputs(variant, device):
    x = randn((5, 200), torch.float16, device, 3)[:, 7:135]
    res = randn((5, 128), torch.float16, device, 4)
    w = randn((128,), torch.float16, device, 5, offset=1.0)
    normed, new_res = fused_add_rms_norm(x, res, w, variant=variant)
    assert_rounded_equal(new_res, x.double() + res.double(), torch.float16)
    assert_close(normed, reference64(new_res, w, 1e-6), torch.float16)


# --------------------------------------------------------------------------------------------- CPU C path
@pytest.fixture
def c_path(c_kernels_only):
    """float32 on the CPU through csrc/cpu/norm_activation.c, with the reference made to fail."""
    c_kernels_only(rmsnorm_module, "rms_norm_reference", "fused_add_rms_norm_reference")


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 127), (2, 3, 576), (2, 5120 + 3)])
def test_c_cpu_path_matches_float64(c_path, shape):
    seed = case_seed("rms-c", shape)
    # rows inside wider buffers (row stride > H), out poisoned around its window
    x = randn((*shape[:-1], shape[-1] + 9), torch.float32, "cpu", seed, scale=3.0, offset=0.5)[..., 4:4 + shape[-1]]
    res = randn(shape, torch.float32, "cpu", seed + 1, scale=2.0)
    w = randn(shape[-1:], torch.float32, "cpu", seed + 2, offset=1.0)
    out_base = poison(torch.empty((*shape[:-1], shape[-1] + 6)))
    out = out_base[..., 3:3 + shape[-1]]
    rms_norm(x, w, eps=1e-5, out=out)
    assert_close(out, reference64(x, w, 1e-5), torch.float32)
    assert torch.isnan(out_base[..., :3]).all() and torch.isnan(out_base[..., 3 + shape[-1]:]).all()
    normed, new_res = fused_add_rms_norm(x, res, w, eps=1e-6)
    assert_rounded_equal(new_res, x.double() + res.double(), torch.float32)
    assert_close(normed, reference64(new_res, w, 1e-6), torch.float32)


def test_c_cpu_path_leaves_other_layouts_to_the_reference(reference_only):
    """A last dimension with a stride (no row view) and half precision take the reference on CPU."""
    xt = randn((300, 6), torch.float32, "cpu", 31).t()
    w = randn((300,), torch.float32, "cpu", 32, offset=1.0)
    assert_close(rms_norm(xt, w), reference64(xt, w, 1e-6), torch.float32)
    xh = randn((3, 64), torch.bfloat16, "cpu", 33)
    wh = randn((64,), torch.bfloat16, "cpu", 34, offset=1.0)
    assert_close(fused_add_rms_norm(xh, xh, wh)[0], reference64(xh.double() * 2, wh, 1e-6), torch.bfloat16)


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda d: rms_norm(torch.ones(2, 4, dtype=torch.int32, device=d), torch.ones(4, device=d)), TypeError, "x must have dtype"),
        (lambda d: rms_norm(torch.ones(2, 4, device=d), torch.ones(5, device=d)), ValueError, "weight must have shape"),
        (lambda d: rms_norm(torch.ones(2, 4, device=d), torch.ones(2, 4, device=d)), ValueError, "weight must be 1-D"),
        (lambda d: rms_norm(torch.ones(2, 0, device=d), torch.ones(0, device=d)), ValueError, "last dimension"),
        (lambda d: rms_norm(torch.ones(2, 4, device=d), torch.ones(4, device=d), eps=-1.0), ValueError, "eps"),
        (lambda d: rms_norm(torch.ones(2, 4, device=d), torch.ones(4, device=d), out=torch.empty(2, 5, device=d)), ValueError, "out must be"),
        (lambda d: rms_norm([1.0, 2.0], torch.ones(2, device=d)), TypeError, "x must be a torch.Tensor"),
        (lambda d: rms_norm(torch.ones(2, 4, device=d), torch.ones(4, device=d), variant="rows"), ValueError,
         "variant must be one of"),
        (lambda d: fused_add_rms_norm(torch.ones(2, 4, device=d), torch.ones(2, 3, device=d), torch.ones(4, device=d)), ValueError, "residual must have"),
        (lambda d: fused_add_rms_norm(torch.ones(2, 4, device=d), torch.ones(2, 4, device=d, dtype=torch.half), torch.ones(4, device=d)), TypeError, "residual must have dtype"),
    ],
)
def test_bad_input_is_rejected_with_a_named_argument(call, error, pattern, device):
    with pytest.raises(error, match=pattern):
        call(device)


def test_mixed_devices_rejected():
    if not torch.cuda.is_available():
        pytest.skip("needs two devices")  # pragma: no cover
    with pytest.raises(ValueError, match="share a device"):
        rms_norm(torch.ones(2, 4, device="cuda"), torch.ones(4))


# --- generated code -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled():
    return compile_module("kernel_lab.ops.rmsnorm", targets=TARGETS)


def test_compiles_for_every_target_without_spills(compiled):
    """No spills anywhere, and no kernel uses more registers than its CTA can have resident on one SM
    (65536 / threads, at most 255): one-row kernels stay within 128 (16 warps at H = 16384)."""
    warps = {spec.name: spec.num_warps for spec in rmsnorm_module.compile_specs()}
    names = check_no_spills(compiled)
    assert len(names) >= 9 and any("multirow" in n for n in names)
    for (name, target), result in compiled.items():
        cap = 128 if "multirow" not in name else min(255, 65536 // (32 * warps[name]))
        assert result["registers"] <= cap, (name, target, result["registers"])


def test_bytes_moved_counts_every_stream_once():
    assert rmsnorm_module.bytes_moved(8, 4096, 2) == 2 * 8 * 4096 * 2 + 4096 * 2
    assert rmsnorm_module.bytes_moved(8, 4096, 2, residual=True, weight_element_size=4) == 4 * 8 * 4096 * 2 + 4096 * 4


def test_sass_uses_128_bit_global_accesses(compiled):
    for (name, target), result in compiled.items():
        loads = set(re.findall(r"LDG\.E[A-Z0-9.]*", result["sass"]))
        stores = set(re.findall(r"STG\.E[A-Z0-9.]*", result["sass"]))
        assert any(op.endswith(".128") for op in loads), (name, target, loads)
        assert any(op.endswith(".128") for op in stores), (name, target, stores)
        assert not any(op.endswith(".U16") for op in loads), f"{name} {target} fell back to 16-bit loads"


# --- GPU-only checks -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, H", [(8192, 4096), (1, 65536), (3, 5), (4096, 16384 + 16), (8191, 8192),
                                     (1025, 32768)])
@pytest.mark.parametrize("gpu_variant", VARIANTS)
def test_gpu_large_shapes(rows, H, dtype, gpu_variant):
    x = randn((rows, H), dtype, "cuda", case_seed("gpu", rows, H, dtype))
    w = randn((H,), dtype, "cuda", 7, offset=1.0)
    assert_close(rms_norm(x, w, variant=gpu_variant), reference64(x, w, 1e-6), dtype)
    normed, new_res = fused_add_rms_norm(x, x.flip(0), w, variant=gpu_variant)
    assert_rounded_equal(new_res, x.double() + x.flip(0).double(), dtype)
    assert_close(normed, reference64(new_res, w, 1e-6), dtype)


@pytest.mark.gpu
def test_gpu_under_cuda_graph():
    x = randn((16, 4096), torch.bfloat16, "cuda", 5)
    w = randn((4096,), torch.bfloat16, "cuda", 6, offset=1.0)
    out = torch.empty_like(x)
    rms_norm(x, w, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rms_norm(x, w, out=out)
    x.copy_(randn((16, 4096), torch.bfloat16, "cuda", 9))
    poison(out)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference64(x, w, 1e-6), torch.bfloat16)
