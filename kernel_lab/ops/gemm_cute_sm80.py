"""Project 03, CuTe DSL, Ampere: `Sm80Gemm`, an `mma.sync` GEMM for sm_80, sm_86, sm_89 (and, unchanged,
sm_90). Its design (layouts, swizzles, pipeline, K residue, epilogue) is described once, in
projects/03_gemm/README.md; host side and dispatch: gemm_cute.py.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .gemm_cute_base import ALIGN_ELEMS, CuteGemm, grouped_tile, predicate_layout

TILE_SM80 = (128, 128, 32)
STAGES_SM80 = 4


class Sm80Gemm(CuteGemm):
    """mma.sync GEMM: one CTA per 128x128 output tile, 4 warps, STAGES_SM80-deep cp.async pipeline."""

    def __init__(self, a_k_major: bool, b_k_major: bool):
        super().__init__(a_k_major, b_k_major)
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

    def launch(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, M, N, stream) -> None:
        dtype = mA.element_type
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
        tile_m, tile_n = grouped_tile(bidx, num_m, num_n)

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
