"""The AOT compile specialisations of project 06's top-k and sampling kernels (`sampling.compile_specs`
returns them): what the compile tests and tools/inspect_triton.py build for sm_80/89/90."""

from __future__ import annotations

from .sampling import (
    MAX_K,
    MERGE_BLOCK,
    SAMPLE_SLOT,
    STREAM_CHUNK,
    _num_warps,
    _rank_chunk,
    _sample_finish_kernel,
    _sample_tile_kernel,
    sample_plan,
    topk_plan,
)
from .topk_kernels import _merge_kernel, _topk_finish_kernel, _topk_tile_kernel


def compile_specs():
    from kernel_lab.harness.compile import CompileSpec

    specs = []
    # One dtype per kernel keeps the compile test affordable on CPU; the dtype only changes the load width.
    for dtype, ty, min_cap in [("bf16", "*bf16", 0)]:
        plan = topk_plan(131072, 64)
        specs.append(CompileSpec(
            name=f"topk_tile_{dtype}", kernel=_topk_tile_kernel,
            signature={"x_ptr": ty, "x_row_stride": "i32", "V": "i32", "k": "i32", "cand_ptr": "*i64",
                       "count_ptr": "*i32", "n_tiles": "i32"},
            constexprs={"TILE": plan["tile"], "SLOT": plan["slot"]}, num_warps=_num_warps(plan["tile"]),
            aligned=("x_ptr", "x_row_stride", "V", "cand_ptr", "count_ptr"), min_capability=min_cap,
        ))
        splan = sample_plan(131072)
        specs.append(CompileSpec(
            name=f"sample_tile_{dtype}", kernel=_sample_tile_kernel,
            signature={"x_ptr": ty, "x_row_stride": "i32", "V": "i32", "temp_ptr": "*fp32",
                       "top_k_ptr": "*i32", "seed_ptr": "*i64", "tile_max_ptr": "*fp32",
                       "tile_sum_ptr": "*fp32", "tile_score_ptr": "*fp32", "tile_idx_ptr": "*i32",
                       "cand_ptr": "*i64", "count_ptr": "*i32", "n_tiles": "i32"},
            constexprs={"TILE": splan["tile"], "SLOT": splan["slot"]}, num_warps=_num_warps(splan["tile"]),
            aligned=("x_ptr", "x_row_stride", "V", "cand_ptr"), min_capability=min_cap,
        ))
    small = sample_plan(48)  # a tiny vocabulary: one 64-wide tile, selected by pairwise ranking
    specs.append(CompileSpec(
        name="sample_tile_bf16_v48", kernel=_sample_tile_kernel, signature=specs[-1].signature,
        constexprs={"TILE": small["tile"], "SLOT": small["slot"]}, num_warps=_num_warps(small["tile"]),
        min_capability=90,
    ))
    splan = sample_plan(131072)
    specs.append(CompileSpec(
        name="sample_finish_bf16", kernel=_sample_finish_kernel,
        signature={"x_ptr": "*bf16", "x_row_stride": "i32", "V": "i32", "temp_ptr": "*fp32",
                   "top_k_ptr": "*i32", "top_p_ptr": "*fp32", "seed_ptr": "*i64", "tile_max_ptr": "*fp32",
                   "tile_sum_ptr": "*fp32", "tile_score_ptr": "*fp32", "tile_idx_ptr": "*i32", "n_tiles": "i32",
                   "cand_ptr": "*i64", "count_ptr": "*i32", "out_ptr": "*i64"},
        constexprs={"TILES": splan["tiles_p2"], "SLOT": splan["slot"], "CHUNK": STREAM_CHUNK,
                    "RANK_CHUNK": _rank_chunk(splan["slot"])},
        num_warps=8, aligned=("x_ptr", "x_row_stride", "V"),
    ))
    specs.append(CompileSpec(
        name="merge_slot1024", kernel=_merge_kernel,
        signature={"in_cand_ptr": "*i64", "in_count_ptr": "*i32", "n_in": "i32", "out_cand_ptr": "*i64",
                   "out_count_ptr": "*i32", "n_out": "i32", "k": "i32", "k_ptr": "*i32", "exact": "i32"},
        constexprs={"PER_ROW_K": True, "SLOT": SAMPLE_SLOT, "GROUP": MERGE_BLOCK // SAMPLE_SLOT},
        num_warps=_num_warps(MERGE_BLOCK), aligned=("in_cand_ptr", "out_cand_ptr"),
    ))
    specs.append(CompileSpec(
        name="topk_finish_k1024", kernel=_topk_finish_kernel,
        signature={"cand_ptr": "*i64", "count_ptr": "*i32", "x_ptr": "*bf16", "x_row_stride": "i32",
                   "values_ptr": "*bf16", "indices_ptr": "*i64", "k": "i32"},
        constexprs={"KP": MAX_K, "RANK_CHUNK": _rank_chunk(MAX_K)}, num_warps=_num_warps(MAX_K),
        aligned=("cand_ptr", "x_ptr", "x_row_stride"),
    ))
    return specs
