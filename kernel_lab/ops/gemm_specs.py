"""The AOT compile specialisations of project 03's GEMM kernels (`gemm.compile_specs` and
`gemm.dispatch_config_specs` return them): what the compile tests, the shared-memory test and
tools/inspect_triton.py build for sm_80/89/90."""

from __future__ import annotations

from .gemm import (
    _LARGE,
    _SMALL_M,
    _SPLIT_K,
    _TMA,
    SPLIT_K_REDUCE_BLOCK,
    TensorDescriptor,
    _matmul_kernel,
    _matmul_persistent_kernel,
    _matmul_splitk_kernel,
    _matmul_tma_kernel,
    _pointer_configs,
    _splitk_reduce_kernel,
    _tma_configs,
    config_shared_bytes,
    fit_shared_memory,
)


def compile_specs():
    """Specialisations compiled for sm_80/89/90 by the compile tests: one per kernel and layout family (each
    compile takes seconds, so the list covers kernels x layouts rather than every autotune config)."""
    from kernel_lab.harness.compile import CompileSpec, targets_fitting

    ints = ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn",
            "M_BUCKET", "LAYOUT")
    aligned = ("a_ptr", "b_ptr", "c_ptr", "M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn",
               "stride_cm")
    # Unit strides are constexprs, as the JIT specialises them at run time. "nn": B row-major [K, N];
    # "nt": B = W^T for a contiguous nn.Linear weight W [N, K].
    unit_strides = {"nn": ("stride_ak", "stride_bn", "stride_cn"),
                    "nt": ("stride_ak", "stride_bk", "stride_cn")}

    def pointer_spec(kernel, name, dtype, layout, config, **extra):
        bm, bn, bk, stages, warps = config
        unit = unit_strides[layout]
        sig = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": f"*{dtype}",
               **{k: "i32" for k in ints if k not in unit}}
        return CompileSpec(
            name=f"{name}_{dtype}_{layout}_{bm}x{bn}x{bk}", kernel=kernel, signature=sig,
            constexprs={**{k: 1 for k in unit}, **extra, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                        "GROUP_M": 8, "UPCAST": False},
            num_warps=warps, num_stages=stages, aligned=tuple(x for x in aligned if x not in unit),
            targets=targets_fitting(config_shared_bytes(bm, bn, bk, stages)))

    specs = [
        pointer_spec(_matmul_kernel, "matmul_tiled", "fp16", "nn", _LARGE[1]),
        pointer_spec(_matmul_kernel, "matmul_tiled", "bf16", "nt", _SMALL_M[0]),
        pointer_spec(_matmul_persistent_kernel, "matmul_persistent", "bf16", "nt", _LARGE[3],
                     NUM_PROGRAMS=132),
    ]
    # split-K: the first config (what runs without autotuning) and the widest-K one, partials in fp32
    for layout, config in (("nt", _SPLIT_K[0]), ("nn", _SPLIT_K[1])):
        bm, bn, bk, stages, warps = config
        unit = unit_strides[layout]
        splitk_ints = [k for k in ints if k not in unit and k not in ("stride_cm", "stride_cn")]
        sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "ws_ptr": "*fp32", **{k: "i32" for k in splitk_ints},
               "stride_ws": "i32", "stride_wm": "i32", "K_PER_SPLIT": "i32"}
        specs.append(CompileSpec(
            name=f"matmul_splitk_bf16_{layout}_{bm}x{bn}x{bk}", kernel=_matmul_splitk_kernel,
            signature={n: sig[n] for n in _matmul_splitk_kernel.arg_names if n in sig},
            constexprs={**{k: 1 for k in unit if k != "stride_cn"}, "stride_wn": 1, "BLOCK_M": bm, "BLOCK_N": bn,
                        "BLOCK_K": bk, "GROUP_M": 8, "UPCAST": False},
            num_warps=warps, num_stages=stages,
            aligned=tuple(x for x in aligned if x not in unit and x not in ("c_ptr", "stride_cm"))
            + ("ws_ptr", "stride_ws", "stride_wm", "K_PER_SPLIT")))
    specs.append(CompileSpec(
        name="splitk_reduce_bf16", kernel=_splitk_reduce_kernel,
        signature={"ws_ptr": "*fp32", "c_ptr": "*bf16", "N": "i32", "SPLITS": "i32", "stride_ws": "i32",
                   "stride_cm": "i32"},
        constexprs={"stride_cn": 1, "BLOCK": SPLIT_K_REDUCE_BLOCK}, num_warps=2,
        aligned=("ws_ptr", "c_ptr", "N", "stride_ws", "stride_cm")))
    if TensorDescriptor is not None:
        for dtype, b_t, (bm, bn, bk, stages, warps) in (("bf16", True, _TMA[0]), ("fp16", False, _TMA[2])):
            b_block = (bn, bk) if b_t else (bk, bn)
            sig = {"a_desc": f"tensordesc<{dtype}[{bm},{bk}]>",
                   "b_desc": f"tensordesc<{dtype}[{b_block[0]},{b_block[1]}]>",
                   "c_desc": f"tensordesc<{dtype}[{bm},{bn}]>", "M": "i32", "N": "i32", "K": "i32",
                   "M_BUCKET": "i32", "LAYOUT": "i32"}
            specs.append(CompileSpec(
                name=f"matmul_tma_{dtype}_{'nt' if b_t else 'nn'}_{bm}x{bn}x{bk}", kernel=_matmul_tma_kernel,
                signature=sig, constexprs={"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8,
                                           "A_TRANSPOSED": False, "B_TRANSPOSED": b_t, "UPCAST": False},
                num_warps=warps, num_stages=stages, min_capability=90))
    return specs


def dispatch_config_specs():
    """Every config the dispatcher may launch on each target (`fit_shared_memory` at the target's limit), for
    the tiled and persistent kernels (bf16, nn.Linear layout) and on sm_90 the TMA kernel; compiled for their
    metadata only, so that the shared memory Triton allocates can be checked against the limit and the bound."""
    from kernel_lab.harness.compile import SHARED_MEMORY_PER_BLOCK, CompileSpec

    base_specs = compile_specs()
    tiled = next(s for s in base_specs if s.name.startswith("matmul_tiled_bf16_nt"))
    persistent = next(s for s in base_specs if s.name.startswith("matmul_persistent_bf16_nt"))
    tma = next((s for s in base_specs if s.name.startswith("matmul_tma_bf16")), None)
    specs = []
    for target, limit in SHARED_MEMORY_PER_BLOCK.items():
        kinds = [(tiled, _pointer_configs()), (persistent, _pointer_configs())]
        if tma is not None and target >= 90:
            kinds.append((tma, _tma_configs()))
        for base, configs in kinds:
            for c in fit_shared_memory(configs, limit):
                bm, bn, bk = (c.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
                signature = dict(base.signature)
                if base is tma:  # the descriptors' block shapes are the config's tiles
                    signature.update(a_desc=f"tensordesc<bf16[{bm},{bk}]>", b_desc=f"tensordesc<bf16[{bn},{bk}]>",
                                     c_desc=f"tensordesc<bf16[{bm},{bn}]>")
                specs.append(CompileSpec(
                    name=f"{base.name.rsplit('_', 1)[0]}_{bm}x{bn}x{bk}s{c.num_stages}w{c.num_warps}_sm{target}",
                    kernel=base.kernel, signature=signature,
                    constexprs={**base.constexprs, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk},
                    num_warps=c.num_warps, num_stages=c.num_stages, aligned=base.aligned, targets=(target,),
                    report=False))
    return specs
