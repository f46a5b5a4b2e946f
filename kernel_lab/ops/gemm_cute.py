"""Project 03, CuTe DSL backend: the `matmul` contract written with NVIDIA's CuTe Python DSL
(`nvidia-cutlass-dsl`). Two kernels, both fp16/bf16 in, fp32 accumulate, C in the input dtype:

- `Sm80Gemm`: Ampere-style `mma.sync` GEMM (runs on sm_80, sm_86, sm_89 and, unchanged, on sm_90).
  128x128x32 CTA tile, 4 warps in a 2x2 arrangement, multistage cp.async pipeline global -> shared,
  `ldmatrix` shared -> registers, `mma.sync.m16n8k16` with fp32 accumulators, and an epilogue that stages
  the tile through shared memory so that global stores are 128-bit and row-coalesced.
- `Sm90Gemm`: Hopper `wgmma` GEMM (sm_90a). 128xTILE_Nx64 CTA tile, TMA bulk copies into 128-byte-swizzled
  shared memory tracked by an mbarrier pipeline, one or two consumer warpgroups issuing asynchronous
  `wgmma.mma_async` straight from shared memory, and a TMA-store epilogue.

The host side passes raw pointers, sizes and leading dimensions (no DLPack): one compiled kernel per
(architecture, dtype, operand majorness) serves every M, N, K. Shapes are dynamic; leading dimensions are
promised divisible by 8 elements (16 bytes) so that every global access can be a 128-bit vector.

Operand conventions inside the kernels follow CuTe: A is (M, K), B is (N, K), C is (M, N). "K-major" means
the K index has unit stride. `matmul(x, w.t())` therefore hands the kernel the [N, K] weight as a K-major B
without a copy; a row-major [K, N] B is an N-major B. Operands that break the 16-byte rules (odd contiguous
extents, misaligned bases) are repacked into padded copies first; see `_prepare`.

Compiling needs no GPU: `compile_for_arch("sm_80" | "sm_89" | "sm_90a", dump_dir)` builds every variant
from fake pointers, and CUTE_DSL_KEEP=ptx,cubin leaves the PTX and cubin in CUTE_DSL_DUMP_DIR for the
compile tests (HMMA / HGMMA in SASS, no local-memory spills).
"""

from __future__ import annotations

import os
import sys

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass.cute.runtime import make_fake_stream, make_ptr

TILE_SM80 = (128, 128, 32)
STAGES_SM80 = 4
TILE_SM90_K = 64
GROUP_M = 8  # tile-rows per group in the L2-friendly raster order (same scheme as the Triton kernels)
ALIGN_ELEMS = 8  # 16 bytes of fp16/bf16


def _grouped_tile(tile_id, num_m, num_n):
    """Linear tile id -> (tile_m, tile_n), GROUP_M tile-rows per column sweep (traced inside kernels)."""
    tiles_per_group = num_n * GROUP_M
    group = tile_id // tiles_per_group
    first_m = group * GROUP_M
    rows = cutlass.min(num_m - first_m, GROUP_M)
    local = tile_id - group * tiles_per_group
    return first_m + local % rows, local // rows


def _operand_layouts(M, N, K, lda, ldb, ldc, a_k_major, b_k_major):
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


# ============================================================================================ sm_80 mma.sync
class Sm80Gemm:
    """mma.sync GEMM: one CTA per 128x128 output tile, 4 warps, STAGES_SM80-deep cp.async pipeline.

    Layouts:
    - Shared A/B tiles are (128, 32, STAGES) built from swizzled 8x32 (K-major) or 64x8 (M/N-major) atoms:
      16-byte chunks stay contiguous for cp.async, and the XOR swizzle spreads the eight rows one
      `ldmatrix` reads across all 32 banks.
    - The tiled MMA is 2x2 warps of m16n8k16 atoms, with N permuted to 32 so each warp's B fragment is one
      `ldmatrix.x4`; each warp covers 64x64 of the tile (4 x 8 atoms), 128 fp32 accumulators per thread.
    K residue: the first K tile is shifted back so that it holds the partial slice; its out-of-range
    columns are never copied (predicated off) and stay at the zero the stage buffer was cleared to, so the
    main loop runs only full tiles. Rows beyond M/N are predicated off in every tile the same way.
    """

    def __init__(self, a_k_major: bool, b_k_major: bool):
        self.a_k_major = a_k_major
        self.b_k_major = b_k_major
        self.bm, self.bn, self.bk = TILE_SM80
        self.stages = STAGES_SM80
        self.threads = 128

    # ---- host-side (traced) helpers
    def _smem_layout(self, k_major: bool, rows: int):
        if k_major:  # rows of 32 K-elements (64 B): 2-bit swizzle over the four 16-byte chunks
            atom = cute.make_composed_layout(cute.make_swizzle(2, 3, 3), 0,
                                             cute.make_layout((8, self.bk), stride=(self.bk, 1)))
        else:  # 64 M/N-elements contiguous (128 B) per K index: 3-bit swizzle over eight chunks
            atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0,
                                             cute.make_layout((64, 8), stride=(1, 64)))
        return cute.tile_to_shape(atom, (rows, self.bk, self.stages), (0, 1, 2))

    def _g2s_copy(self, dtype, k_major: bool, rows: int):
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                                   dtype, num_bits_per_copy=128)
        if k_major:  # 4 threads cover one 32-element row; 32 rows per pass
            per_row = self.bk // ALIGN_ELEMS
            threads = cute.make_layout((self.threads // per_row, per_row), stride=(per_row, 1))
            values = cute.make_layout((1, ALIGN_ELEMS))
        else:  # 16 threads cover 128 contiguous M/N elements; 8 K-rows per pass
            per_col = rows // ALIGN_ELEMS
            threads = cute.make_layout((per_col, self.threads // per_col), stride=(1, per_col))
            values = cute.make_layout((ALIGN_ELEMS, 1))
        return cute.make_tiled_copy_tv(atom, threads, values)

    @cute.jit
    def __call__(self, a_ptr: cute.Pointer, b_ptr: cute.Pointer, c_ptr: cute.Pointer, M: cutlass.Int32,
             N: cutlass.Int32, K: cutlass.Int32, lda: cutlass.Int32, ldb: cutlass.Int32,
             ldc: cutlass.Int32, stream: cuda.CUstream):
        dtype = a_ptr.value_type
        layout_a, layout_b, layout_c = _operand_layouts(M, N, K, lda, ldb, ldc, self.a_k_major,
                                                        self.b_k_major)
        mA = cute.make_tensor(a_ptr, layout_a)
        mB = cute.make_tensor(b_ptr, layout_b)
        mC = cute.make_tensor(c_ptr, layout_c)
        sA_layout = self._smem_layout(self.a_k_major, self.bm)
        sB_layout = self._smem_layout(self.b_k_major, self.bn)
        # C staging tile: row-major with 8 elements of padding per row, so the accumulator fragments
        # (two consecutive values per thread, eight rows per warp) land in distinct banks and rows
        # stay 16-byte aligned for the vector read-back.
        sC_layout = cute.make_layout((self.bm, self.bn), stride=(self.bn + ALIGN_ELEMS, 1))
        copy_a = self._g2s_copy(dtype, self.a_k_major, self.bm)
        copy_b = self._g2s_copy(dtype, self.b_k_major, self.bn)
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
        per_row = self.bn // ALIGN_ELEMS
        copy_c = cute.make_tiled_copy_tv(
            store_atom, cute.make_layout((self.threads // per_row, per_row), stride=(per_row, 1)),
            cute.make_layout((1, ALIGN_ELEMS)))
        mma = cute.make_tiled_mma(
            cute.nvgpu.warp.MmaF16BF16Op(dtype, cutlass.Float32, (16, 8, 16)),
            cute.make_layout((2, 2, 1)), permutation_mnk=(32, 32, 16))
        num_m = (M + self.bm - 1) // self.bm
        num_n = (N + self.bn - 1) // self.bn
        self.kernel(mA, mB, mC, sA_layout, sB_layout, sC_layout, copy_a, copy_b, copy_c, mma).launch(
            grid=[num_m * num_n, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, sA_layout: cute.ComposedLayout,
               sB_layout: cute.ComposedLayout, sC_layout: cute.Layout, copy_a: cute.TiledCopy,
               copy_b: cute.TiledCopy, copy_c: cute.TiledCopy, mma: cute.TiledMma):
        bm, bn, bk, stages = self.bm, self.bn, self.bk, self.stages
        dtype = mA.element_type
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        M, K = mA.shape
        N = mB.shape[0]
        num_m = (M + bm - 1) // bm
        num_n = (N + bn - 1) // bn
        tile_m, tile_n = _grouped_tile(bidx, num_m, num_n)

        # (bm, bk, k_tiles) views of this CTA's panels, and coordinate tensors for predication.
        gA = cute.local_tile(mA, (bm, bk), (tile_m, None))
        gB = cute.local_tile(mB, (bn, bk), (tile_n, None))
        cA = cute.local_tile(cute.make_identity_tensor(mA.shape), (bm, bk), (tile_m, None))
        cB = cute.local_tile(cute.make_identity_tensor(mB.shape), (bn, bk), (tile_n, None))
        k_tiles = cute.size(gA, mode=[2])
        # Shift the K tiling back by the residue (<= 0): tile 0 becomes the partial one.
        residue = K - k_tiles * bk
        gA = cute.domain_offset((0, residue, 0), gA)
        gB = cute.domain_offset((0, residue, 0), gB)
        cA = cute.domain_offset((0, residue, 0), cA)
        cB = cute.domain_offset((0, residue, 0), cB)
        # The shift is a multiple of 8 elements along a unit-stride K, or of a leading dimension: the panel
        # bases stay 16-byte aligned.
        gA = cute.make_tensor(gA.iterator.align(16), gA.layout)
        gB = cute.make_tensor(gB.iterator.align(16), gB.layout)

        @cute.struct
        class Storage:
            a: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sA_layout)], 128]
            b: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sB_layout)], 128]

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(Storage)
        sA = storage.a.get_tensor(sA_layout)
        sB = storage.b.get_tensor(sB_layout)
        # The epilogue reuses the operand stages once the main loop is done: sC (34 KiB with its padding)
        # covers the A stages (32 KiB) and the start of the B stages, which follow them contiguously.
        sC = cute.make_tensor(cute.recast_ptr(sA.iterator, dtype=dtype), sC_layout)

        thr_a = copy_a.get_slice(tidx)
        thr_b = copy_b.get_slice(tidx)
        tAgA = thr_a.partition_S(gA)  # (CPY, CPY_M, CPY_K, k_tiles)
        tAsA = thr_a.partition_D(sA)  # (CPY, CPY_M, CPY_K, stages)
        tAcA = thr_a.partition_S(cA)
        tBgB = thr_b.partition_S(gB)
        tBsB = thr_b.partition_D(sB)
        tBcB = thr_b.partition_S(cB)

        # Predicates, one per 16-byte vector: (rest, CPY_M, CPY_K). `full` tests rows only (K is in
        # range for every tile after the first); `first` also drops the columns left of K = 0.
        pA_full = cute.make_rmem_tensor(predicate_layout(tAgA), cutlass.Boolean)
        pA_first = cute.make_rmem_tensor(predicate_layout(tAgA), cutlass.Boolean)
        pB_full = cute.make_rmem_tensor(predicate_layout(tBgB), cutlass.Boolean)
        pB_first = cute.make_rmem_tensor(predicate_layout(tBgB), cutlass.Boolean)
        for r in cutlass.range_constexpr(pA_full.shape[0]):
            for i in cutlass.range_constexpr(pA_full.shape[1]):
                for j in cutlass.range_constexpr(pA_full.shape[2]):
                    coord = tAcA[(0, r), i, j, 0]
                    row_ok = cute.elem_less(coord[0], M)
                    pA_full[r, i, j] = row_ok
                    pA_first[r, i, j] = row_ok & cute.elem_less(-1, coord[1])
        for r in cutlass.range_constexpr(pB_full.shape[0]):
            for i in cutlass.range_constexpr(pB_full.shape[1]):
                for j in cutlass.range_constexpr(pB_full.shape[2]):
                    coord = tBcB[(0, r), i, j, 0]
                    row_ok = cute.elem_less(coord[0], N)
                    pB_full[r, i, j] = row_ok
                    pB_first[r, i, j] = row_ok & cute.elem_less(-1, coord[1])

        # Skipped vectors must read as zero: clear every stage once before the first copy.
        tAsA.fill(0)
        tBsB.fill(0)
        cute.arch.sync_threads()

        # Prologue: tiles 0 .. stages-2 in flight (one commit group each, empty groups past the end
        # keep the group count uniform for the wait below).
        cute.copy(copy_a, tAgA[None, None, None, 0], tAsA[None, None, None, 0], pred=pA_first)
        cute.copy(copy_b, tBgB[None, None, None, 0], tBsB[None, None, None, 0], pred=pB_first)
        cute.arch.cp_async_commit_group()
        for s in cutlass.range_constexpr(1, stages - 1):
            if s < k_tiles:
                cute.copy(copy_a, tAgA[None, None, None, s], tAsA[None, None, None, s], pred=pA_full)
                cute.copy(copy_b, tBgB[None, None, None, s], tBsB[None, None, None, s], pred=pB_full)
            cute.arch.cp_async_commit_group()

        thr_mma = mma.get_slice(tidx)
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = mma.make_fragment_A(tCsA[None, None, None, 0])
        tCrB = mma.make_fragment_B(tCsB[None, None, None, 0])
        gC = cute.local_tile(mC, (bm, bn), (tile_m, tile_n))
        acc = mma.make_fragment_C(thr_mma.partition_C(gC))
        acc.fill(0.0)

        # Shared -> register copies that produce exactly the MMA's operand fragments. M/N-major
        # operands need ldmatrix's transposing form.
        ldm_a = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(not self.a_k_major, 4), dtype)
        ldm_b = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(not self.b_k_major, 4), dtype)
        s2r_a = cute.make_tiled_copy_A(ldm_a, mma)
        s2r_b = cute.make_tiled_copy_B(ldm_b, mma)
        thr_s2r_a = s2r_a.get_slice(tidx)
        thr_s2r_b = s2r_b.get_slice(tidx)
        tXsA = thr_s2r_a.partition_S(sA)
        tXrA = thr_s2r_a.retile(tCrA)
        tXsB = thr_s2r_b.partition_S(sB)
        tXrB = thr_s2r_b.retile(tCrB)
        k_blocks = cute.size(tCrA, mode=[2])

        # Main loop. Per K tile: wait until its group landed, barrier (which also guarantees every
        # warp finished reading the stage about to be refilled), refill that stage with the tile
        # stages-1 ahead, then run the tile's k-blocks from shared memory.
        for kt in range(k_tiles):
            cute.arch.cp_async_wait_group(stages - 2)
            cute.arch.sync_threads()
            fetch = kt + stages - 1
            if fetch < k_tiles:
                slot = fetch % stages
                cute.copy(copy_a, tAgA[None, None, None, fetch], tAsA[None, None, None, slot], pred=pA_full)
                cute.copy(copy_b, tBgB[None, None, None, fetch], tBsB[None, None, None, slot], pred=pB_full)
            cute.arch.cp_async_commit_group()
            stage = kt % stages
            for kb in cutlass.range_constexpr(k_blocks):
                cute.copy(s2r_a, tXsA[None, None, kb, stage], tXrA[None, None, kb])
                cute.copy(s2r_b, tXsB[None, None, kb, stage], tXrB[None, None, kb])
                cute.gemm(mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)

        # Epilogue: round to the output dtype, stage through shared memory, then 128-bit row stores.
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        out = cute.make_fragment_like(acc, dtype)
        out.store(acc.load().to(dtype))
        cute.autovec_copy(out, thr_mma.partition_C(sC))
        cute.arch.sync_threads()

        thr_c = copy_c.get_slice(tidx)
        tDsC = thr_c.partition_S(sC)
        tDgC = thr_c.partition_D(gC)
        tDcC = thr_c.partition_D(cute.local_tile(cute.make_identity_tensor(mC.shape), (bm, bn),
                                                 (tile_m, tile_n)))
        staged = cute.make_fragment_like(tDsC)
        cute.autovec_copy(tDsC, staged)
        pC = cute.make_rmem_tensor(predicate_layout(tDgC), cutlass.Boolean)
        for r in cutlass.range_constexpr(pC.shape[0]):
            for i in cutlass.range_constexpr(pC.shape[1]):
                for j in cutlass.range_constexpr(pC.shape[2]):
                    coord = tDcC[(0, r), i, j]
                    pC[r, i, j] = cute.elem_less(coord[0], M) & cute.elem_less(coord[1], N)
        cute.copy(copy_c, staged, tDgC, pred=pC)


# ============================================================================================ sm_90 wgmma
SM90_SMEM_BYTES = 232448  # opt-in shared memory per block on H100/H200
SM90_EPI_STAGES = 4


class Sm90Gemm:
    """wgmma GEMM: one CTA per 128 x tile_n output tile, two consumer warpgroups (64 rows each).

    Layouts and data movement:
    - A (M, K) and B (N, K) reach shared memory only through TMA: one bulk tensor copy per operand per K
      tile, into 128-byte-swizzled (K-major or MN-major, whichever the operand is) layouts that wgmma reads
      directly through shared-memory descriptors. TMA zero-fills rows/columns beyond M, N and K, so there is
      no predication anywhere in the main loop.
    - Pipeline: `stages` buffers (as many as fit in shared memory), each with a "full" mbarrier (TMA
      transaction bytes) and an "empty" mbarrier (one arrive per consumer warp). Warp 0 issues the copies;
      all eight warps wait on "full", issue the tile's four k16 wgmmas asynchronously, and keep one group
      in flight: a stage is released (and refilled with the tile `stages` ahead) only after the *previous*
      tile's wgmmas have retired.
    - Epilogue: accumulators -> output dtype -> `stmatrix` into a swizzled (128, 32) staging buffer (4 deep,
      reusing the A stages) -> TMA store, which also clips the tile at M and N.
    """

    def __init__(self, a_k_major: bool, b_k_major: bool, tile_n: int = 256):
        self.a_k_major = a_k_major
        self.b_k_major = b_k_major
        self.bm, self.bn, self.bk = 128, tile_n, TILE_SM90_K
        self.threads = 256
        self.epi_tile = (128, 32)
        stage_bytes = (self.bm + self.bn) * self.bk * 2
        self.stages = min(7, (SM90_SMEM_BYTES - 1024) // stage_bytes)

    @cute.jit
    def __call__(self, a_ptr: cute.Pointer, b_ptr: cute.Pointer, c_ptr: cute.Pointer, M: cutlass.Int32,
                 N: cutlass.Int32, K: cutlass.Int32, lda: cutlass.Int32, ldb: cutlass.Int32,
                 ldc: cutlass.Int32, stream: cuda.CUstream):
        dtype = a_ptr.value_type
        layout_a, layout_b, layout_c = _operand_layouts(M, N, K, lda, ldb, ldc, self.a_k_major,
                                                        self.b_k_major)
        mA = cute.make_tensor(a_ptr, layout_a)
        mB = cute.make_tensor(b_ptr, layout_b)
        mC = cute.make_tensor(c_ptr, layout_c)
        a_enum = cutlass.utils.LayoutEnum.from_tensor(mA)
        b_enum = cutlass.utils.LayoutEnum.from_tensor(mB)
        c_enum = cutlass.utils.LayoutEnum.from_tensor(mC)
        tile_mnk = (self.bm, self.bn, self.bk)
        self.dtype = dtype  # the TMA views below are coordinate tensors; the kernel reads the dtype here
        mma = sm90_utils.make_trivial_tiled_mma(dtype, dtype, a_enum.sm90_mma_major_mode(),
                                                b_enum.sm90_mma_major_mode(), cutlass.Float32, (2, 1, 1),
                                                tiler_mn=(64, self.bn))
        sA_layout = sm90_utils.make_smem_layout_a(a_enum, tile_mnk, dtype, self.stages)
        sB_layout = sm90_utils.make_smem_layout_b(b_enum, tile_mnk, dtype, self.stages)
        sC_layout = sm90_utils.make_smem_layout_epi(dtype, c_enum, self.epi_tile, SM90_EPI_STAGES)
        tma_a, gmem_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(sA_layout, (None, None, 0)),
            (self.bm, self.bk))
        tma_b, gmem_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mB, cute.slice_(sB_layout, (None, None, 0)),
            (self.bn, self.bk))
        tma_c, gmem_c = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mC, cute.slice_(sC_layout, (None, None, 0)),
            self.epi_tile)
        num_m = (M + self.bm - 1) // self.bm
        num_n = (N + self.bn - 1) // self.bn
        self.kernel(tma_a, gmem_a, tma_b, gmem_b, tma_c, gmem_c, mma, sA_layout, sB_layout, sC_layout,
                    c_enum).launch(grid=[num_m * num_n, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, gmem_a: cute.Tensor, tma_b: cute.CopyAtom, gmem_b: cute.Tensor,
               tma_c: cute.CopyAtom, gmem_c: cute.Tensor, mma: cute.TiledMma, sA_layout: cute.ComposedLayout,
               sB_layout: cute.ComposedLayout, sC_layout: cute.ComposedLayout, c_enum: cutlass.Constexpr):
        bm, bn, bk, stages = self.bm, self.bn, self.bk, self.stages
        dtype = self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
        M, K = gmem_a.shape
        N = gmem_b.shape[0]
        num_m = (M + bm - 1) // bm
        num_n = (N + bn - 1) // bn
        tile_m, tile_n = _grouped_tile(bidx, num_m, num_n)

        @cute.struct
        class Storage:
            barriers: cute.struct.MemRange[cutlass.Int64, stages * 2]
            a: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sA_layout)], 1024]
            b: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sB_layout)], 1024]

        storage = cutlass.memory.SmemAllocator().allocate(Storage)
        stage_bytes = cute.size_in_bytes(dtype, cute.slice_(sA_layout, (None, None, 0))) + \
            cute.size_in_bytes(dtype, cute.slice_(sB_layout, (None, None, 0)))
        loads = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(), num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads // 32),
            tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sA = storage.a.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.b.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        gA = cute.local_tile(gmem_a, (bm, bk), (tile_m, None))  # (bm, bk, k_tiles)
        gB = cute.local_tile(gmem_b, (bn, bk), (tile_n, None))
        gC = cute.local_tile(gmem_c, (bm, bn), (tile_m, tile_n))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2),
                                                      cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2),
                                                      cute.group_modes(gB, 0, 2))

        warpgroup = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma = mma.get_slice(warpgroup * 128)
        tCrA = mma.make_fragment_A(thr_mma.partition_A(sA))  # shared-memory descriptors, per stage
        tCrB = mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gC).shape, cutlass.Float32)
        acc.fill(0.0)
        mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        k_tiles = cute.size(gA, mode=[2])
        k_blocks = cute.size(tCrA, mode=[2])
        produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
        consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)

        if warp == 0:  # fill the pipeline
            for _ in cutlass.range(cutlass.min(stages, k_tiles), unroll=1):
                loads.producer_acquire(produce)
                barrier = loads.producer_get_barrier(produce)
                cute.copy(tma_a, tAgA[(None, produce.count)], tAsA[(None, produce.index)], tma_bar_ptr=barrier)
                cute.copy(tma_b, tBgB[(None, produce.count)], tBsB[(None, produce.index)], tma_bar_ptr=barrier)
                loads.producer_commit(produce)
                produce.advance()

        for kt in cutlass.range(k_tiles, unroll=1):
            loads.consumer_wait(consume)
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range_constexpr(k_blocks):
                cute.gemm(mma, acc, tCrA[(None, None, kb, consume.index)], tCrB[(None, None, kb, consume.index)],
                          acc)
            cute.nvgpu.warpgroup.commit_group()
            # Keep this tile's wgmmas in flight; the previous tile's are now retired, so its stage is free.
            cute.nvgpu.warpgroup.wait_group(1)
            if kt > 0:
                loads.consumer_release(release)
                release.advance()
                if warp == 0 and produce.count < k_tiles:
                    loads.producer_acquire(produce)
                    barrier = loads.producer_get_barrier(produce)
                    cute.copy(tma_a, tAgA[(None, produce.count)], tAsA[(None, produce.index)],
                              tma_bar_ptr=barrier)
                    cute.copy(tma_b, tBgB[(None, produce.count)], tBsB[(None, produce.index)],
                              tma_bar_ptr=barrier)
                    loads.producer_commit(produce)
                    produce.advance()
            consume.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        # Every TMA load has landed and every wgmma retired: the A stages can hold the output.
        cute.arch.sync_threads()

        sC = cute.make_tensor(cute.recast_ptr(sA.iterator, sC_layout.inner, dtype=dtype), sC_layout.outer)
        stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(c_enum.is_m_major_c(), 4), dtype)
        r2s = cute.make_tiled_copy_S(sm90_utils.get_smem_store_op(c_enum, dtype, cutlass.Float32),
                                     cute.make_tiled_copy_C_atom(stmatrix, mma))
        thr_r2s = r2s.get_slice(tidx)
        tRS_sC = thr_r2s.partition_D(sC)  # (R2S, R2S_M, R2S_N, epi stages)
        tRS_acc = r2s.retile(acc)
        piece_layout = cute.make_layout(cute.shape(thr_r2s.partition_S(sC))[:3])
        piece = cute.make_rmem_tensor(piece_layout, cutlass.Float32)
        piece_size = cute.size(piece)
        gC_pieces = cute.zipped_divide(gC, self.epi_tile)  # ((128, 32), (1, bn / 32))
        bSG_sC, bSG_gC = cute.nvgpu.cpasync.tma_partition(tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
                                                          gC_pieces)
        stores = pipeline.PipelineTmaStore.create(
            num_stages=SM90_EPI_STAGES, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads))
        pieces = cute.size(gC_pieces, mode=[1])
        for p in cutlass.range_constexpr(pieces):
            for v in cutlass.range_constexpr(piece_size):
                piece[v] = tRS_acc[p * piece_size + v]
            rounded = cute.make_rmem_tensor(piece_layout, dtype)
            rounded.store(piece.load().to(dtype))
            buf = p % SM90_EPI_STAGES
            cute.copy(r2s, rounded, tRS_sC[(None, None, None, buf)])
            # Make the generic-proxy shared stores visible to the TMA (async proxy), then let one warp store.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
            if warp == 0:
                cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, (0, p))])
                stores.producer_commit()
                stores.producer_acquire()
            cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
        if warp == 0:
            stores.producer_tail()


# ============================================================================================ host side
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


def compile_artifacts(arch: str, out_dir: str, only=None) -> list[dict]:
    """Compile kernels for `arch` from fake pointers and write <variant>.<arch>.{ptx,cubin} to out_dir.
    Needs CUTE_DSL_KEEP=ptx,cubin and an existing CUTE_DSL_DUMP_DIR in the environment before import."""
    written = []
    for dtype, a_k, b_k in (only if only is not None else COMPILE_TEST_VARIANTS[arch]):
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


def start_compile_child(out_dir: str, archs=("sm_80", "sm_89", "sm_90a")):
    """Start compile_artifacts for `archs` in one child process and return its Popen (finish with
    `finish_compile_child`). The DSL reads its KEEP/DUMP settings at import; the architecture is a
    per-compile option, so one process serves all of them. Starting it early lets it overlap other work."""
    import subprocess

    os.makedirs(out_dir, exist_ok=True)
    dump = os.path.join(out_dir, "dsl-dump")
    os.makedirs(dump, exist_ok=True)
    env = {**os.environ, "CUTE_DSL_KEEP": "ptx,cubin", "CUTE_DSL_DUMP_DIR": dump}
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-m", "kernel_lab.ops.gemm_cute", "--out", out_dir,
                             "--archs", ",".join(archs)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    proc.out_dir = out_dir
    return proc


def finish_compile_child(proc, timeout: int = 900) -> list[dict]:
    import json

    stdout, stderr = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"CuTe compile failed:\n{stdout[-4000:]}\n{stderr[-8000:]}")
    with open(os.path.join(proc.out_dir, "summary.json")) as f:
        return json.load(f)


def compile_in_child(out_dir: str, archs=("sm_80", "sm_89", "sm_90a"), timeout: int = 900) -> list[dict]:
    return finish_compile_child(start_compile_child(out_dir, archs), timeout)


def _main(argv=None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="Compile the CuTe GEMM kernels without a GPU.")
    parser.add_argument("--out", required=True)
    parser.add_argument("--archs", default="sm_80,sm_89,sm_90a")
    parser.add_argument("--all-variants", action="store_true", help="every dtype/majorness, not the test subset")
    args = parser.parse_args(argv)
    summary = []
    for arch in args.archs.split(","):
        summary += compile_artifacts(arch, args.out, variants() if args.all_variants else None)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
