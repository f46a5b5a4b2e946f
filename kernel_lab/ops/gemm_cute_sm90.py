"""Project 03, CuTe DSL, Hopper: `Sm90Gemm`, a `wgmma` GEMM with TMA loads and stores for sm_90a. Its design
(tiling, swizzled layouts, mbarrier pipeline, epilogue) is described once, in projects/03_gemm/README.md;
host side and dispatch: gemm_cute.py.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils

from .gemm_cute_base import CuteGemm, grouped_tile

TILE_SM90_K = 64
SM90_SMEM_BYTES = 232448  # opt-in shared memory per block on H100/H200
SM90_EPI_STAGES = 4


class Sm90Gemm(CuteGemm):
    """wgmma GEMM: one CTA per 128 x tile_n output tile, two consumer warpgroups (64 rows each), TMA in and out."""

    def __init__(self, a_k_major: bool, b_k_major: bool, tile_n: int = 256):
        super().__init__(a_k_major, b_k_major)
        self.bm, self.bn, self.bk = 128, tile_n, TILE_SM90_K
        self.threads = 256
        self.epi_tile = (128, 32)
        stage_bytes = (self.bm + self.bn) * self.bk * 2
        self.stages = min(7, (SM90_SMEM_BYTES - 1024) // stage_bytes)

    def launch(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, M, N, stream) -> None:
        dtype = mA.element_type
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
        tile_m, tile_n = grouped_tile(bidx, num_m, num_n)

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
