"""What the CuTe DSL GEMMs (gemm_cute_sm80.py, gemm_cute_sm90.py) share: the operand layouts over raw
pointers, the grouped tile raster, copy predicates, and `CuteGemm`, whose `__call__` is both kernels' host
prologue (global tensors from pointers, sizes and leading dimensions) before each one's own launch.

Operand conventions follow CuTe: A is (M, K), B is (N, K), C is (M, N). "K-major" means the K index has unit
stride. Leading dimensions are promised divisible by 8 elements (16 bytes) so that every global access can
be a 128-bit vector.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

GROUP_M = 8  # tile-rows per group in the L2-friendly raster order (same scheme as the Triton kernels)
ALIGN_ELEMS = 8  # 16 bytes of fp16/bf16


def grouped_tile(tile_id, num_m, num_n):
    """Linear tile id -> (tile_m, tile_n), GROUP_M tile-rows per column sweep (traced inside kernels)."""
    tiles_per_group = num_n * GROUP_M
    group = tile_id // tiles_per_group
    first_m = group * GROUP_M
    rows = cutlass.min(num_m - first_m, GROUP_M)
    local = tile_id - group * tiles_per_group
    return first_m + local % rows, local // rows


def operand_layouts(M, N, K, lda, ldb, ldc, a_k_major, b_k_major):
    """Global layouts (A: (M,K), B: (N,K), C: (M,N) row-major). The host guarantees (see `_prepare`) that
    leading dimensions and every unit-stride extent are multiples of 8 elements, so each 16-byte vector is
    either wholly inside the matrix or wholly outside it."""
    N = cute.assume(N, divby=ALIGN_ELEMS)  # C is row-major
    if a_k_major or b_k_major:
        K = cute.assume(K, divby=ALIGN_ELEMS)
    if not a_k_major:
        M = cute.assume(M, divby=ALIGN_ELEMS)
    lda = cute.assume(lda, divby=ALIGN_ELEMS)
    ldb = cute.assume(ldb, divby=ALIGN_ELEMS)
    ldc = cute.assume(ldc, divby=ALIGN_ELEMS)
    layout_a = cute.make_layout((M, K), stride=(lda, 1)) if a_k_major else cute.make_layout((M, K), stride=(1, lda))
    layout_b = cute.make_layout((N, K), stride=(ldb, 1)) if b_k_major else cute.make_layout((N, K), stride=(1, ldb))
    layout_c = cute.make_layout((M, N), stride=(ldc, 1))
    return layout_a, layout_b, layout_c


def predicate_layout(t):
    """Compact (rest, rows, cols) layout with one predicate per copy vector of partition `t`."""
    rows = cute.size(t, mode=[1])
    cols = cute.size(t, mode=[2])
    return cute.make_layout((t.shape[0][1], rows, cols), stride=(rows * cols, cols, 1))


class CuteGemm:
    """Base of the CuTe GEMMs: the operands' majorness, and a `__call__` that builds the global tensors and
    hands them to the subclass's `launch(mA, mB, mC, M, N, stream)` (traced, like everything it calls)."""

    def __init__(self, a_k_major: bool, b_k_major: bool):
        self.a_k_major = a_k_major
        self.b_k_major = b_k_major

    @cute.jit
    def __call__(self, a_ptr: cute.Pointer, b_ptr: cute.Pointer, c_ptr: cute.Pointer, M: cutlass.Int32,
                 N: cutlass.Int32, K: cutlass.Int32, lda: cutlass.Int32, ldb: cutlass.Int32,
                 ldc: cutlass.Int32, stream: cuda.CUstream):
        layout_a, layout_b, layout_c = operand_layouts(M, N, K, lda, ldb, ldc, self.a_k_major, self.b_k_major)
        mA = cute.make_tensor(a_ptr, layout_a)
        mB = cute.make_tensor(b_ptr, layout_b)
        mC = cute.make_tensor(c_ptr, layout_c)
        self.launch(mA, mB, mC, M, N, stream)

    def launch(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, M, N, stream) -> None:
        raise NotImplementedError
