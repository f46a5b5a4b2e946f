"""Project 03 correctness: `matmul` (Triton and CuTe DSL backends) vs a float64 reference of the same
(already rounded) inputs, with error bounds that grow with K.

On a machine without CUDA the Triton kernels run through the interpreter on small shapes (its bf16 dot is
defective, so the kernels upcast bf16 to fp32 there; see docs/shared notes), the CuTe backend falls back to
the reference on CPU tensors, and both backends are compiled for sm_80 / sm_89 / sm_90a to check the
generated instructions. The GPU tests (marked `gpu`) run both backends on large and odd shapes.
"""

import importlib.util
import os
import re

import pytest
import torch

from kernel_lab.harness.compile import TARGETS, arch_name, check_no_spills, compile_module, triton_bin
from kernel_lab.harness.testing import assert_close, case_seed, poison, randn
from kernel_lab.ops import gemm, matmul

DTYPES = [torch.float16, torch.bfloat16]
HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
NO_CUTLASS = "nvidia-cutlass-dsl (`import cutlass`) is not installed: CuTe DSL backend not tested here"


@pytest.fixture(autouse=True, scope="module")
def fixed_configs():
    """On a GPU, skip autotuning (the first pruned config runs): every new shape would otherwise compile and
    time several configs. test_gpu_every_config checks each config of the autotune lists explicitly."""
    previous = os.environ.get("KERNEL_LAB_GEMM_AUTOTUNE")
    os.environ["KERNEL_LAB_GEMM_AUTOTUNE"] = "0"
    yield
    if previous is None:
        os.environ.pop("KERNEL_LAB_GEMM_AUTOTUNE", None)
    else:
        os.environ["KERNEL_LAB_GEMM_AUTOTUNE"] = previous


def k_scale(K: int) -> float:
    """Tolerance multiplier: the per-dtype bounds cover the final rounding to fp16/bf16; fp32 accumulation
    adds an error that grows with the number of terms, budgeted here as linear in K."""
    return 1.0 + K / 4096


def reference64(a, b):
    return a.double().cpu() @ b.double().cpu()


def make_operands(M, N, K, dtype, device, layout, seed):
    """a [M, K] and b [K, N] in the requested memory layout (values independent of the layout).

    nn: both row-major.  nt: b = W^T for a row-major W [N, K] (nn.Linear).  tn: a = X^T for X [K, M].
    strided: neither operand has a unit stride in either dimension.
    """
    a = randn((M, K), dtype, device, seed)
    b = randn((K, N), dtype, device, seed + 1)
    if layout == "nt":
        b = b.t().contiguous().t()
    elif layout == "tn":
        a = a.t().contiguous().t()
    elif layout == "strided":
        a_big = poison(torch.empty((2 * M, 3 * K), dtype=dtype, device=device))
        a_big[::2, ::3] = a
        b_big = poison(torch.empty((3 * K, 2 * N), dtype=dtype, device=device))
        b_big[::3, ::2] = b
        a, b = a_big[::2, ::3], b_big[::3, ::2]
    return a, b


# --------------------------------------------------------------------------------------------- Triton
@pytest.mark.parametrize("variant", ["auto", "splitk"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "strided"])
@pytest.mark.parametrize("M, N, K", [(1, 40, 33), (5, 17, 64), (33, 70, 45), (64, 96, 130), (3, 20, 24)])
def test_triton_matches_float64(M, N, K, layout, dtype, variant, device):
    # (3, 20, 24): one K block, so the split-K variant stores straight into C without a reduction pass;
    # K = 130 splits into 64 + 64 + 2 under the interpreter (a split whose K range ends inside a block).
    a, b = make_operands(M, N, K, dtype, device, layout, case_seed("mm", M, N, K, layout, dtype))
    out = poison(torch.empty((M, N), dtype=dtype, device=device))
    y = matmul(a, b, out=out, variant=variant)
    assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
    assert_close(y, reference64(a, b), dtype, scale=k_scale(K), msg=f"{variant} {layout} {M}x{N}x{K}")


def test_splitk_plan_covers_k_without_empty_splits():
    for M, N, K, programs in [(1, 2048, 1536, 264), (16, 1536, 8960, 264), (1, 28672, 4096, 264),
                              (32, 4096, 14336, 264), (1, 64, 100, 264), (7, 96, 130, 4)]:
        splits, k_per_split = gemm.splitk_plan(M, N, K, programs)
        assert 1 <= splits <= gemm.SPLIT_K_MAX and k_per_split % gemm.SPLIT_K_GRANULE == 0
        assert (splits - 1) * k_per_split < K <= splits * k_per_split, (M, N, K, splits, k_per_split)
    assert gemm.splitk_plan(16, 1536, 8960, 264)[0] > 8, "decode down-projection must fill the SMs"
    assert gemm.splitk_plan(1, 28672, 4096, 264)[0] == 1, "enough N tiles: no split, no reduction"


def test_bytes_moved_adds_the_partials_only_when_split():
    assert gemm.bytes_moved(16, 1536, 8960, 2) == (16 * 8960 + 8960 * 1536 + 16 * 1536) * 2
    assert gemm.bytes_moved(16, 1536, 8960, 2, splits=14) - gemm.bytes_moved(16, 1536, 8960, 2) == 2 * 14 * 16 * 1536 * 4
    assert gemm.bytes_moved(1, 64, 64, 2, splits=1) == gemm.bytes_moved(1, 64, 64, 2)


def test_splitk_configs_fit_an_sm89_block():
    """Operand buffers of every split-K config (stages * (BM*BK + BK*BN) * 2 bytes, an upper bound on what
    Triton allocates) fit the 101,376 B of shared memory an L4 block may use, so no config needs a filter."""
    for bm, bn, bk, stages, _ in gemm._SPLIT_K:
        assert stages * (bm * bk + bk * bn) * 2 <= gemm.SPLIT_K_SMEM_LIMIT, (bm, bn, bk, stages)
    assert len(gemm._SPLIT_K) > 3


@pytest.mark.parametrize("variant", ["tiled", "persistent", "tma", "splitk"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, N, K, layout", [(37, 48, 64, "nt"), (96, 40, 88, "nn"), (16, 72, 40, "tn")])
def test_every_triton_variant(M, N, K, layout, variant, dtype, device):
    # Shapes keep 16-byte-aligned rows so the TMA variant accepts them; the tiles (32x32 under the
    # interpreter) do not divide M or N, so the boundary handling of every kernel is exercised.
    a, b = make_operands(M, N, K, dtype, device, layout, case_seed("var", M, N, K, dtype))
    if variant == "tma" and device.type == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA variant needs sm_90")
    y = matmul(a, b, variant=variant)
    assert_close(y, reference64(a, b), dtype, scale=k_scale(K), msg=variant)


def test_tma_variant_rejects_unaligned_operands(device):
    a = randn((8, 33), torch.float16, device, 1)  # 66-byte rows: no TMA descriptor possible
    b = randn((33, 16), torch.float16, device, 2)
    if device.type == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs sm_90 for the capability check to pass first")
    with pytest.raises(ValueError, match="variant='tma' needs 16-byte-aligned"):
        matmul(a, b, variant="tma")
    assert gemm._tma_view(a) is None and gemm._tma_view(b) is not None


def test_linear_weight_is_read_in_place(monkeypatch, device):
    """matmul(x, w.t()) hands the kernel w's own storage and strides: no contiguous copy first."""
    seen = {}
    real = gemm._launch_pointer

    def spy(kind, a, b, c, upcast):
        seen.update(ptr=b.data_ptr(), stride=b.stride())
        return real(kind, a, b, c, upcast)

    monkeypatch.setattr(gemm, "_launch_pointer", spy)
    x = randn((3, 64), torch.float16, device, 5)
    w = randn((48, 64), torch.float16, device, 6)
    y = matmul(x, w.t(), variant="tiled")
    assert seen == {"ptr": w.data_ptr(), "stride": (1, 64)}
    assert_close(y, reference64(x, w.t()), torch.float16, scale=k_scale(64))
    view, transposed = gemm._tma_view(w.t())
    assert transposed and view.data_ptr() == w.data_ptr() and view.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_out(dtype, device):
    a, b = make_operands(20, 36, 50, dtype, device, "nn", 7)
    base = poison(torch.empty((36, 40), dtype=dtype, device=device))
    out = base[:, 3:23].t()  # column-major out with a padded leading dimension
    matmul(a, b, out=out)
    assert_close(out, reference64(a, b), dtype, scale=k_scale(50))
    assert torch.isnan(base[:, :3].float()).all() and torch.isnan(base[:, 23:].float()).all()


@pytest.mark.parametrize("M, N, K", [(0, 8, 8), (8, 0, 8), (8, 8, 0), (0, 0, 0)])
def test_empty_dimensions(M, N, K, device):
    a = randn((M, K), torch.bfloat16, device, 1)
    b = randn((K, N), torch.bfloat16, device, 2)
    y = matmul(a, b)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    assert torch.equal(y.cpu(), torch.zeros((M, N), dtype=torch.bfloat16))
    out = poison(torch.empty((M, N), dtype=torch.bfloat16, device=device))
    assert torch.equal(matmul(a, b, out=out, backend="cute").cpu(), torch.zeros((M, N), dtype=torch.bfloat16))


def test_inputs_are_not_modified(device):
    a, b = make_operands(17, 24, 40, torch.float16, device, "nt", 3)
    a0, b0 = a.clone(), b.clone()
    matmul(a, b)
    assert torch.equal(a, a0) and torch.equal(b, b0)


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda d: matmul(torch.ones(2, 4, dtype=torch.int32, device=d), torch.ones(4, 3, device=d)), TypeError,
         "a must have dtype"),
        (lambda d: matmul(torch.ones(2, 4, device=d), torch.ones(4, 3, device=d)), TypeError, "a must have dtype"),
        (lambda d: matmul(torch.ones(2, 4, dtype=torch.half, device=d), torch.ones(4, 3, dtype=torch.bfloat16, device=d)),
         TypeError, "b must have a's dtype float16"),
        (lambda d: matmul(torch.ones(2, 4, dtype=torch.half, device=d), torch.ones(5, 3, dtype=torch.half, device=d)),
         ValueError, r"b must have shape \(4, N\)"),
        (lambda d: matmul(torch.ones(4, dtype=torch.half, device=d), torch.ones(4, 3, dtype=torch.half, device=d)),
         ValueError, "a must be 2-D"),
        (lambda d: matmul(torch.ones(2, 4, dtype=torch.half, device=d), torch.ones(1, 4, 3, dtype=torch.half, device=d)),
         ValueError, "b must be 2-D"),
        (lambda d: matmul(torch.ones(2, 4, dtype=torch.half, device=d), torch.ones(4, 3, dtype=torch.half, device=d),
                          out=torch.empty(3, 2, dtype=torch.half, device=d)), ValueError, r"out must have shape \(2, 3\)"),
        (lambda d: matmul(torch.ones(2, 4, dtype=torch.half, device=d), torch.ones(4, 3, dtype=torch.half, device=d),
                          out=torch.empty(2, 3, device=d)), TypeError, "out must have dtype"),
        (lambda d: matmul(torch.ones(2, 4, dtype=torch.half, device=d), torch.ones(4, 3, dtype=torch.half, device=d),
                          backend="cublas"), ValueError, "backend must be one of"),
        (lambda d: matmul(torch.ones(2, 4, dtype=torch.half, device=d), torch.ones(4, 3, dtype=torch.half, device=d),
                          variant="split_k"), ValueError, "variant must be one of"),
        (lambda d: matmul([[1.0]], torch.ones(1, 3, dtype=torch.half, device=d)), TypeError, "a must be a torch.Tensor"),
    ],
)
def test_bad_input_is_rejected_with_a_named_argument(call, error, pattern, device):
    with pytest.raises(error, match=pattern):
        call(device)


def test_mixed_devices_rejected():
    if not torch.cuda.is_available():
        pytest.skip("needs two devices")  # pragma: no cover
    with pytest.raises(ValueError, match="share a device"):
        matmul(torch.ones(2, 4, dtype=torch.half, device="cuda"), torch.ones(4, 3, dtype=torch.half))


def test_cpu_reference_path_without_interpreter(reference_only):
    a, b = make_operands(7, 9, 11, torch.bfloat16, "cpu", "tn", 4)
    assert_close(matmul(a, b), reference64(a, b), torch.bfloat16, scale=k_scale(11))


# --------------------------------------------------------------------------------------------- CuTe, CPU side
@pytest.mark.parametrize("dtype", DTYPES)
def test_cute_backend_on_cpu_follows_the_contract(dtype):
    a, b = make_operands(6, 10, 24, dtype, "cpu", "nt", 8)
    out = poison(torch.empty((6, 10), dtype=dtype))
    y = matmul(a, b, out=out, backend="cute")
    assert y.data_ptr() == out.data_ptr()
    assert_close(y, reference64(a, b), dtype, scale=k_scale(24))


def _kernel_view(t, k_major, ld, rows, cols):
    """What the CuTe kernel reads from `t` given (k_major, ld): a (rows, cols) = (M|N, K) matrix."""
    stride = (ld, 1) if k_major else (1, ld)
    return t.as_strided((rows, cols), stride, t.storage_offset())


@pytest.mark.skipif(not HAS_CUTLASS, reason=NO_CUTLASS)
@pytest.mark.parametrize("M, N, K, layout", [(64, 48, 32, "nt"), (64, 48, 32, "tn"), (1, 40, 33, "nn"),
                                             (9, 20, 16, "strided"), (16, 24, 40, "nn")])
def test_cute_host_side_hands_the_kernel_the_padded_problem(M, N, K, layout):
    """_prepare's operands, read the way the kernel reads them, are the zero-padded problem: same product,
    16-byte-aligned leading dimensions, and in-place operands whenever the layout allows it."""
    from kernel_lab.ops import gemm_cute

    a, b = make_operands(M, N, K, torch.float16, "cpu", layout, 9)
    out = torch.empty((M, N), dtype=torch.float16)
    a_op, a_k, lda, b_op, b_k, ldb, c_op, ldc, m, n, k = gemm_cute._prepare(a, b, out)
    assert (m, n % 8, k % 8, k >= K, n >= N) == (M, 0, 0, True, True)
    for ld, t in ((lda, a_op), (ldb, b_op), (ldc, c_op)):
        assert ld % 8 == 0 and t.data_ptr() % 16 == 0
    a_seen = _kernel_view(a_op, a_k, lda, m, k).double()
    b_seen = _kernel_view(b_op, b_k, ldb, n, k).double()
    assert torch.equal(a_seen[:, :K], a.double()) and not a_seen[:, K:].any()
    assert torch.equal(b_seen[:N, :K], b.t().double()) and not b_seen[:, K:].any() and not b_seen[N:].any()
    if layout in ("nt", "tn") and K % 8 == 0 and N % 8 == 0:
        assert a_op.data_ptr() == a.data_ptr() and b_op.data_ptr() == b.data_ptr(), "aligned operands are not copied"
        assert (a_k, b_k) == (layout == "nt", layout == "nt")
    assert (c_op is out) == (N % 8 == 0)


# --------------------------------------------------------------------------------------------- generated code
@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Triton specs (harness child process) and CuTe kernels (their own child), built concurrently."""
    cute_child = None
    if HAS_CUTLASS:
        from kernel_lab.ops.gemm_cute import start_compile_child

        cute_child = start_compile_child(str(tmp_path_factory.mktemp("cute")))
    try:
        triton_results = compile_module("kernel_lab.ops.gemm", targets=TARGETS)
    except BaseException:
        if cute_child is not None:
            cute_child.kill()
        raise
    cute_results = None
    if cute_child is not None:
        from kernel_lab.harness.compile import finish_compile_child

        cute_results = finish_compile_child(cute_child)
    return triton_results, cute_results


@pytest.fixture(scope="module")
def triton_compiled(compiled):
    return compiled[0]


def test_triton_compiles_without_spills(triton_compiled):
    names = check_no_spills(triton_compiled, targets=None)
    assert {n.split("_")[1] for n in names} == {"tiled", "persistent", "tma", "splitk", "reduce"}
    specs = {s.name: s for s in gemm.compile_specs()}
    for name in names:  # the TMA kernel is sm_90-only; the others build for each target whose shared memory fits
        spec = specs[name]
        expected = {"sm_90a"} if "_tma_" in name else {arch_name(t) for t in spec.targets or TARGETS}
        assert {t for n, t in triton_compiled if n == name} == expected, name
    assert "sm_80" in {t for n, t in triton_compiled if "_tiled_" in n}
    assert "sm_89" in {t for n, t in triton_compiled if "_tiled_" in n}


def test_splitk_sass_stores_fp32_partials_and_reduces_them_in_a_second_pass(triton_compiled):
    """The split-K reduction is a second pass, not atomics: the tile kernel stores fp32 partials with
    128-bit stores and never converts to bf16; the reduce kernel loads them 128 bits at a time and adds."""
    for (name, target), result in triton_compiled.items():
        sass = result["sass"]
        if name.startswith("matmul_splitk"):
            assert "STG.E.128" in sass and "F2FP" not in sass, (name, target)
            assert not re.search(r"\b(RED|ATOM)\.", sass), (name, target)
        elif name.startswith("splitk_reduce"):
            assert "LDG.E.128" in sass and "FADD" in sass and "F2FP.BF16" in sass, (name, target)
            assert not re.search(r"\b(RED|ATOM)\.", sass), (name, target)


def test_triton_sass_uses_tensor_cores(triton_compiled):
    for (name, target), result in triton_compiled.items():
        sass = result["sass"]
        if name.startswith("splitk_reduce"):
            continue
        if target in ("sm_80", "sm_89"):
            assert re.search(r"\bHMMA\.16816\.F32", sass), (name, target)
            assert "LDGSTS" in sass, f"{name} {target}: no cp.async pipeline"
        elif int(name.rsplit("_", 1)[1].split("x")[0]) >= 64:  # BLOCK_M fills a warpgroup
            assert re.search(r"\bHGMMA\.64x\d+x16\.F32", sass), f"{name} {target}: no warpgroup MMA"
        else:  # 16-row tiles are below wgmma's 64-row minimum: mma.sync on Hopper too
            assert re.search(r"\bHMMA\.16816\.F32", sass), (name, target)
        if name.startswith("matmul_tma"):
            assert "UTMALDG" in sass and "UTMASTG" in sass, f"{name}: loads/stores not through TMA"


@pytest.fixture(scope="module")
def cute_compiled(compiled):
    if compiled[1] is None:
        pytest.skip(NO_CUTLASS)
    return compiled[1]


def _resource_usage(cubin_path):
    import subprocess

    text = subprocess.run([triton_bin("cuobjdump"), "-res-usage", cubin_path], capture_output=True, text=True,
                          check=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|LOCAL|STACK):(\d+)", text)}


def test_cute_kernels_compile_for_every_target(cute_compiled):
    from kernel_lab.harness.compile import sass

    archs = {entry["arch"] for entry in cute_compiled}
    assert archs == {"sm_80", "sm_89", "sm_90a"}
    for entry in cute_compiled:
        usage = _resource_usage(entry["cubin"])
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0, (entry["name"], entry["arch"], usage)
        assert usage["REG"] <= 255, (entry["name"], entry["arch"], usage)
        with open(entry["cubin"], "rb") as f:
            code = sass(f.read())
        with open(entry["ptx"]) as f:
            ptx = f.read()
        where = f"{entry['name']} {entry['arch']}"
        if entry["arch"] == "sm_90a":
            assert re.search(r"\bHGMMA\.64x256x16\.F32", code), f"{where}: no warpgroup MMA"
            assert "UTMALDG" in code and "UTMASTG" in code, f"{where}: loads/stores not through TMA"
            assert "wgmma.mma_async" in ptx and "HMMA" not in code
        else:
            assert re.search(r"\bHMMA\.16816\.F32", code), f"{where}: no mma.sync"
            assert "mma.sync.aligned.m16n8k16" in ptx
            assert re.search(r"LDGSTS\.E\.[A-Z0-9.]*128", code), f"{where}: no 128-bit cp.async"
            transposed = "_am_" in entry["name"]
            assert ("LDSM.16.MT88" in code) == transposed and "LDSM.16.M88" in code.replace("MT88", "M88")
            assert "STG.E.128" in code, f"{where}: epilogue stores are not 128-bit"
        if "bf16" in entry["name"]:
            assert "bf16" in ptx


# --------------------------------------------------------------------------------------------- GPU only
GPU_SHAPES = [(4096, 4096, 4096), (1, 4096, 4096), (16, 1536, 8960), (127, 1000, 333), (4096, 8960, 1536),
              (3, 7, 5), (257, 4104, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cute"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, N, K", GPU_SHAPES)
def test_gpu_matches_fp32_torch(M, N, K, dtype, backend):
    if backend == "cute" and not HAS_CUTLASS:
        pytest.skip(NO_CUTLASS)
    for layout in ("nt", "nn"):
        a, b = make_operands(M, N, K, dtype, "cuda", layout, case_seed("gpu", M, N, K, dtype, layout))
        out = poison(torch.empty((M, N), dtype=dtype, device="cuda"))
        matmul(a, b, out=out, backend=backend)
        ref = torch.matmul(a.float(), b.float())
        assert_close(out, ref, dtype, scale=k_scale(K), msg=f"{backend} {layout} {M}x{N}x{K}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cute"])
def test_gpu_transposed_and_strided_operands(backend):
    if backend == "cute" and not HAS_CUTLASS:
        pytest.skip(NO_CUTLASS)
    for layout in ("tn", "strided"):
        for M, N, K in ((512, 768, 1024), (100, 72, 200)):
            a, b = make_operands(M, N, K, torch.bfloat16, "cuda", layout, case_seed("gpu-t", M, N, K, layout))
            y = matmul(a, b, backend=backend)
            assert_close(y, torch.matmul(a.float(), b.float()), torch.bfloat16, scale=k_scale(K))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["tiled", "persistent", "tma", "splitk"])
def test_gpu_triton_variants(variant):
    if variant == "tma" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA variant needs sm_90")
    for M, N, K in ((2048, 2048, 2048), (1, 1536, 1536), (300, 520, 4096), (16, 1536, 8960), (32, 4104, 4099)):
        if variant != "splitk" and M in (16, 32):
            continue
        a, b = make_operands(M, N, K, torch.bfloat16, "cuda", "nt", case_seed("gpu-v", M, N, K))
        y = matmul(a, b, variant=variant)
        assert_close(y, torch.matmul(a.float(), b.float()), torch.bfloat16, scale=k_scale(K), msg=variant)
        if variant == "splitk":  # the second-pass reduction sums in split order: the same bits every run
            assert torch.equal(matmul(a, b, variant=variant), y)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["tiled", "tma", "splitk"])
def test_gpu_every_config(kind):
    """Each config the autotuner may pick, launched directly on one shape that no tile divides."""
    import triton

    if kind == "tma" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA kernel needs sm_90")
    M, N, K = 300, 264, 328  # 16-byte rows (TMA), no tile size divides M or N, K not a multiple of BLOCK_K
    a, b = make_operands(M, N, K, torch.bfloat16, "cuda", "nt", case_seed("cfg", kind))
    ref = torch.matmul(a.float(), b.float())
    configs = {"tma": gemm._TMA, "tiled": gemm._LARGE + gemm._SMALL_M, "splitk": gemm._SPLIT_K}[kind]
    splits, k_per_split = 3, 128  # 128 + 128 + 72 of K = 328
    ws = torch.empty((splits, M, N), dtype=torch.float32, device="cuda")
    failures = []
    for bm, bn, bk, stages, warps in configs:
        c = poison(torch.empty((M, N), dtype=torch.bfloat16, device="cuda"))
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, UPCAST=False, num_warps=warps,
                    num_stages=stages)
        try:
            if kind == "tma":
                descs = (gemm.TensorDescriptor.from_tensor(a, [bm, bk]),
                         gemm.TensorDescriptor.from_tensor(b.t(), [bn, bk]),
                         gemm.TensorDescriptor.from_tensor(c, [bm, bn]))
                gemm._matmul_tma_kernel[grid](*descs, M, N, K, 0, 0, A_TRANSPOSED=False, B_TRANSPOSED=True,
                                              **meta)
            elif kind == "splitk":
                poison(ws)
                gemm._matmul_splitk_kernel[grid + (splits,)](a, b, ws, M, N, K, *a.stride(), *b.stride(),
                                                             *ws.stride(), k_per_split, 0, 0, **meta)
                gemm._splitk_reduce_kernel[(M, triton.cdiv(N, gemm.SPLIT_K_REDUCE_BLOCK))](
                    ws, c, N, splits, ws.stride(0), *c.stride(), BLOCK=gemm.SPLIT_K_REDUCE_BLOCK, num_warps=2)
            else:
                gemm._matmul_kernel[grid](a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride(), 0, 0, **meta)
        except triton.runtime.errors.OutOfResources:
            continue  # the autotuner skips such configs on this GPU too
        try:
            assert_close(c, ref, torch.bfloat16, scale=k_scale(K))
        except AssertionError as exc:
            failures.append(f"{(bm, bn, bk, stages, warps)}: {exc}")
    assert not failures, failures


@pytest.mark.gpu
def test_gpu_no_copies_for_linear_weights():
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpLog(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = randn((64, 4096), torch.bfloat16, "cuda", 1)
    w = randn((1024, 4096), torch.bfloat16, "cuda", 2)
    out = torch.empty((64, 1024), dtype=torch.bfloat16, device="cuda")
    matmul(x, w.t(), out=out)  # autotune outside the log
    with OpLog() as log:
        matmul(x, w.t(), out=out)
    assert not [op for op in log.ops if "copy" in op or "clone" in op or "contiguous" in op], log.ops


@pytest.mark.gpu
def test_gpu_under_cuda_graph():
    a = randn((64, 2048), torch.bfloat16, "cuda", 3)
    w = randn((1024, 2048), torch.bfloat16, "cuda", 4)
    out = torch.empty((64, 1024), dtype=torch.bfloat16, device="cuda")
    matmul(a, w.t(), out=out)  # autotune before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        matmul(a, w.t(), out=out)
    a.copy_(randn((64, 2048), torch.bfloat16, "cuda", 5))
    poison(out)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, torch.matmul(a.float(), w.float().t()), torch.bfloat16, scale=k_scale(2048))
