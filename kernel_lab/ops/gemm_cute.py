"""Project 03, CuTe DSL backend: the `matmul` contract written with NVIDIA's CuTe Python DSL
(`nvidia-cutlass-dsl`), host side. Two kernels, both fp16/bf16 in, fp32 accumulate, C in the input dtype:
`Sm80Gemm` (`mma.sync`, gemm_cute_sm80.py) for sm_80/86/89 and `Sm90Gemm` (`wgmma` + TMA, gemm_cute_sm90.py)
for sm_90a, on the shared base of gemm_cute_base.py.

The host side passes raw pointers, sizes and leading dimensions (no DLPack): one compiled kernel per
(architecture, dtype, operand majorness) serves every M, N, K. Shapes are dynamic; leading dimensions are
promised divisible by 8 elements (16 bytes) so that every global access can be a 128-bit vector.

`matmul(x, w.t())` hands the kernel the [N, K] weight as a K-major B without a copy; a row-major [K, N] B is
an N-major B. Operands that break the 16-byte rules (odd contiguous extents, misaligned bases) are repacked
into padded copies first; see `_prepare`.

Compiling needs no GPU: `compile_artifacts("sm_80" | "sm_89" | "sm_90a", out_dir)` builds variants from fake
pointers, and `start_compile_child` runs it in harness.compile's child process with CUTE_DSL_KEEP=ptx,cubin,
so the compile tests can read the PTX and cubin (HMMA / HGMMA in SASS, no local-memory spills).
"""

from __future__ import annotations

import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_stream, make_ptr

from .gemm_cute_base import ALIGN_ELEMS
from .gemm_cute_sm80 import Sm80Gemm
from .gemm_cute_sm90 import Sm90Gemm

_TORCH_TO_CUTLASS = {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}
_NAME_TO_CUTLASS = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}


def make_gemm(arch: str, a_k_major: bool, b_k_major: bool):
    """The kernel for `arch` ("sm_80", "sm_89", "sm_90a", ...): wgmma on sm_90a, mma.sync elsewhere."""
    if arch == "sm_90a":
        return Sm90Gemm(a_k_major, b_k_major)
    return Sm80Gemm(a_k_major, b_k_major)


def _compile(arch: str, dtype, a_k_major: bool, b_k_major: bool, a_ptr=None, b_ptr=None, c_ptr=None,
             stream=None):
    gemm = make_gemm(arch, a_k_major, b_k_major)
    if a_ptr is None:  # no GPU needed: fake 16-byte-aligned pointers and a fake stream
        a_ptr, b_ptr, c_ptr = (make_ptr(dtype, 16, cute.AddressSpace.gmem, assumed_align=16)
                               for _ in range(3))
        stream = make_fake_stream()
    return cute.compile(gemm, a_ptr, b_ptr, c_ptr, 128, 128, 128, 128, 128, 128, stream,
                        options=f"--gpu-arch {arch}")


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _as_operand(t: torch.Tensor) -> tuple[torch.Tensor, bool, int] | None:
    """(t, k_major, ld) when the kernel can read the (M, K) or (N, K) operand `t` in place, else None.
    Size-1 modes get a harmless leading dimension (it is never stepped)."""
    if not _aligned(t):
        return None
    rows, cols = t.shape
    if t.stride(1) == 1 or cols == 1:  # inner (K) contiguous
        ld = t.stride(0) if rows > 1 else _round_up(max(cols, 1), ALIGN_ELEMS)
        if cols % ALIGN_ELEMS == 0 and ld % ALIGN_ELEMS == 0 and ld >= cols:
            return t, True, ld
    if t.stride(0) == 1 or rows == 1:  # outer (M or N) contiguous
        ld = t.stride(1) if cols > 1 else _round_up(max(rows, 1), ALIGN_ELEMS)
        if rows % ALIGN_ELEMS == 0 and ld % ALIGN_ELEMS == 0 and ld >= rows:
            return t, False, ld
    return None


def _packed(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-padded, K-contiguous copy of t (shape (r, c)) with (rows, cols) >= (r, c)."""
    out = torch.zeros((rows, cols), dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]].copy_(t)
    return out


def _prepare(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor):
    """Operands in the forms the kernels accept, repacking only what breaks the 16-byte rules.

    Returns (a_op, a_k_major, lda, b_op, b_k_major, ldb, c_op, ldc, M, N, K) with b_op in CuTe's (N, K)
    orientation; c_op is `out` itself or a padded temporary the caller copies back.
    """
    M, K = a.shape
    N = b.shape[1]
    a_view = _as_operand(a)
    b_view = _as_operand(b.t())
    k_pad = _round_up(K, ALIGN_ELEMS)
    n_pad = _round_up(N, ALIGN_ELEMS)
    # Zero padding along K adds nothing to the dot products, so one padded K serves both operands; N is
    # padded for the output's 16-byte row vectors (the extra columns land in a temporary).
    if a_view is None or b_view is None or k_pad != K or n_pad != N:
        if k_pad != K or a_view is None:
            a_view = (_packed(a, M, k_pad), True, k_pad)
        if k_pad != K or n_pad != N or b_view is None:
            b_view = (_packed(b.t(), n_pad, k_pad), True, k_pad)
    c_direct = (out.stride(1) == 1 or N == 1) and _aligned(out) and n_pad == N and \
        (M == 1 or out.stride(0) % ALIGN_ELEMS == 0)
    if c_direct:
        c_op, ldc = out, (out.stride(0) if M > 1 else n_pad)
    else:
        c_op = torch.empty((M, n_pad), dtype=out.dtype, device=out.device)
        ldc = n_pad
    a_op, a_k, lda = a_view
    b_op, b_k, ldb = b_view
    for name, t, ld, rows in (("a", a_op, lda, M), ("b", b_op, ldb, n_pad), ("out", c_op, ldc, M)):
        if max(rows, 1) * ld >= 2**31 or t.numel() >= 2**31:
            raise ValueError(f"{name} spans 2^31 elements or more; the CuTe backend indexes with int32")
    return a_op, a_k, lda, b_op, b_k, ldb, c_op, ldc, M, n_pad, k_pad


def _device_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return "sm_90a" if major == 9 else f"sm_{major}{minor}"


_compiled: dict = {}


def matmul_cute(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """C = A @ B on a CUDA device with the CuTe kernels (inputs already validated by gemm.matmul)."""
    a_op, a_k, lda, b_op, b_k, ldb, c_op, ldc, M, N, K = _prepare(a, b, out)
    dtype = _TORCH_TO_CUTLASS[a.dtype]
    arch = _device_arch(a.device)
    stream = cuda.CUstream(torch.cuda.current_stream(a.device).cuda_stream)
    ptrs = [make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16) for t in (a_op, b_op, c_op)]
    key = (arch, a.dtype, a_k, b_k)
    fn = _compiled.get(key)
    if fn is None:
        fn = _compiled[key] = _compile(arch, dtype, a_k, b_k, *ptrs, stream=stream)
    fn(*ptrs, M, N, K, lda, ldb, ldc, stream)
    if c_op is not out:
        out.copy_(c_op[:, : out.shape[1]])
    return out


def variants():
    """(dtype name, a_k_major, b_k_major) of every kernel family matmul_cute can compile."""
    return [(d, a, b) for d in ("fp16", "bf16") for a in (True, False) for b in (True, False)]


# What the compile tests build per architecture (each compile costs seconds of CPU): both dtypes, the
# nn.Linear layout (K-major A and B), and fully transposed operands (ldmatrix.trans / MN-major wgmma).
COMPILE_TEST_VARIANTS = {
    "sm_80": [("fp16", True, True), ("bf16", False, False)],
    "sm_89": [("bf16", True, True)],
    "sm_90a": [("bf16", True, True), ("fp16", False, False)],
}


def variant_name(dtype: str, a_k_major: bool, b_k_major: bool) -> str:
    return f"{dtype}_a{'k' if a_k_major else 'm'}_b{'k' if b_k_major else 'n'}"


def compile_artifacts(arch: str, out_dir: str, only: str | None = None) -> list[dict]:
    """Compile kernels for `arch` from fake pointers and write <variant>.<arch>.{ptx,cubin} to out_dir:
    the compile tests' subset, every variant (`only="all"`) or one (`only=variant_name(...)`). Needs
    CUTE_DSL_KEEP=ptx,cubin and an existing CUTE_DSL_DUMP_DIR in the environment before import, which
    `start_compile_child` sets up; harness.compile's child process calls this."""
    if only is None:
        chosen = COMPILE_TEST_VARIANTS[arch]
    else:
        chosen = [v for v in variants() if only in ("all", variant_name(*v))]
        if not chosen:
            raise ValueError(f"only must be 'all' or a variant name such as {variant_name(*variants()[0])!r}, "
                             f"got {only!r}")
    written = []
    for dtype, a_k, b_k in chosen:
        fn = _compile(arch, _NAME_TO_CUTLASS[dtype], a_k, b_k)
        stem = os.path.join(out_dir, f"{variant_name(dtype, a_k, b_k)}.{arch}")
        cubin = fn.artifacts.CUBIN
        ptx = fn.artifacts.PTX
        if cubin is None or ptx is None:
            raise RuntimeError("no artifacts kept: set CUTE_DSL_KEEP=ptx,cubin and CUTE_DSL_DUMP_DIR before import")
        with open(stem + ".cubin", "wb") as f:
            f.write(cubin)
        with open(stem + ".ptx", "w") as f:
            f.write(ptx)
        written.append({"name": variant_name(dtype, a_k, b_k), "arch": arch, "cubin": stem + ".cubin",
                        "ptx": stem + ".ptx"})
    return written


def start_compile_child(out_dir: str, archs=("sm_80", "sm_89", "sm_90a"), only: str | None = None):
    """`compile_artifacts` for `archs` in harness.compile's child process, with the DSL told (before it is
    imported) to keep PTX and cubin. The architecture is a per-compile option, so one process serves all of
    them. Finish with `harness.compile.finish_compile_child`."""
    from kernel_lab.harness.compile import start_compile_child as start_child

    dump = os.path.join(out_dir, "dsl-dump")
    os.makedirs(dump, exist_ok=True)
    targets = [int(arch[3:5]) for arch in archs]
    return start_child(__name__, targets, only, out_dir, env={"CUTE_DSL_KEEP": "ptx,cubin", "CUTE_DSL_DUMP_DIR": dump})
