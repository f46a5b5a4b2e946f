"""Project 03: FP16/BF16 GEMM, one contract with two implementations (Triton here, CuTe DSL in gemm_cute.py).

    C[M, N] = A[M, K] @ B[K, N]       fp16 or bf16 inputs, fp32 accumulation, C in the input dtype

Any strides are accepted: `matmul(x, w.t())` reads an [N, K] weight in place. The traffic model and the
Triton kernels (tiled, persistent, TMA, and split-K for decode-sized M): projects/03_gemm/README.md.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .common import HALF_DTYPES, check_same_device, check_tensor, interpreter_active, use_triton

BACKENDS = ("triton", "cute")
VARIANTS = ("auto", "tiled", "persistent", "tma", "splitk")

try:  # host-side TMA descriptors: triton >= 3.4 (present in 3.6 and 3.9)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None


# --------------------------------------------------------------------------------------------- reference
def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 accumulation, one rounding to the input dtype: what the kernels compute."""
    return torch.matmul(a.float(), b.float()).to(a.dtype)


# --------------------------------------------------------------------------------------------- kernels
@triton.jit
def _grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile id -> (pid_m, pid_n), walking GROUP_M tile-rows down one tile-column before moving right."""
    tiles_per_group = GROUP_M * num_pid_n
    group = tile_id // tiles_per_group
    first_m = group * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    local = tile_id % tiles_per_group
    return first_m + local % rows, local // rows


@triton.jit
def _tile_accumulate(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, pid_m, pid_n,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr):
    # Row/column indices wrap modulo M/N instead of being masked: the wrapped rows are valid memory, their
    # results are discarded by the store mask, and the loads in the K loop need only the K mask.
    offs_m = ((pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M).to(tl.int64)
    offs_n = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    # int64 only for the base offsets (M * stride may pass 2^31); the K walk advances the pointers.
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST:  # Triton's interpreter multiplies raw bf16 bit patterns in tl.dot; fp32 is exact there
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _store_tile(c_ptr, acc, M, N, stride_cm, stride_cn, pid_m, pid_n,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    M_BUCKET, LAYOUT,  # autotune keys only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _grouped_tile(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    acc = _tile_accumulate(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, pid_m, pid_n,
                           BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
    _store_tile(c_ptr, acc, M, N, stride_cm, stride_cn, pid_m, pid_n, BLOCK_M, BLOCK_N)


@triton.jit
def _matmul_persistent_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    M_BUCKET, LAYOUT,  # autotune keys only
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for tile_id in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        pid_m, pid_n = _grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = _tile_accumulate(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, pid_m,
                               pid_n, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
        _store_tile(c_ptr, acc, M, N, stride_cm, stride_cn, pid_m, pid_n, BLOCK_M, BLOCK_N)


@triton.jit
def _matmul_splitk_kernel(
    a_ptr, b_ptr, ws_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_ws, stride_wm, stride_wn,
    K_PER_SPLIT, M_BUCKET, LAYOUT,  # the last two: autotune keys only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Program (tile, split) accumulates K range [split * K_PER_SPLIT, +K_PER_SPLIT) of one output tile and
    # stores it at ws[split]: fp32 partials reduced by _splitk_reduce_kernel, or C itself (cast on store)
    # when there is a single split. The K mask of the tile loop clips the range, so K_PER_SPLIT need not be
    # a multiple of BLOCK_K (the host makes it one of 128, so every split starts 16-byte aligned).
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _grouped_tile(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    split = tl.program_id(1)
    k_start = split.to(tl.int64) * K_PER_SPLIT
    k_len = tl.minimum(K - k_start, K_PER_SPLIT)
    acc = _tile_accumulate(a_ptr + k_start * stride_ak, b_ptr + k_start * stride_bk, M, N, k_len,
                           stride_am, stride_ak, stride_bk, stride_bn, pid_m, pid_n,
                           BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
    _store_tile(ws_ptr + split.to(tl.int64) * stride_ws, acc, M, N, stride_wm, stride_wn, pid_m, pid_n,
                BLOCK_M, BLOCK_N)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, c_ptr, N, SPLITS, stride_ws, stride_cm, stride_cn, BLOCK: tl.constexpr):
    # The second pass: C[m, n] = sum over splits of ws[split, m, n], in split order (deterministic: the
    # same inputs give the same bits on every run, unlike an atomic-add reduction).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    src = ws_ptr + row * N + cols
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for _ in range(SPLITS):
        acc += tl.load(src, mask=mask, other=0.0)
        src += stride_ws
    tl.store(c_ptr + row * stride_cm + cols * stride_cn, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _matmul_tma_kernel(
    a_desc, b_desc, c_desc, M, N, K,
    M_BUCKET, LAYOUT,  # autotune keys only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_TRANSPOSED: tl.constexpr, B_TRANSPOSED: tl.constexpr, UPCAST: tl.constexpr,
):
    # a_desc describes A as [M, K] (or A^T as [K, M] when A_TRANSPOSED); b_desc describes B as [K, N] (or
    # B^T as [N, K] when B_TRANSPOSED, the nn.Linear weight layout). Whichever view has unit stride last.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _grouped_tile(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        off_k = k * BLOCK_K
        if A_TRANSPOSED:
            a = a_desc.load([off_k, off_m]).T
        else:
            a = a_desc.load([off_m, off_k])
        if B_TRANSPOSED:
            b = b_desc.load([off_n, off_k]).T
        else:
            b = b_desc.load([off_k, off_n])
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


# --------------------------------------------------------------------------------------------- configs
def _cfg(bm, bn, bk, stages, warps, group=8, pre_hook=None):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group},
                         num_stages=stages, num_warps=warps, pre_hook=pre_hook)


# (M, N, K tile, stages, warps). Large tiles for compute-bound shapes; 16/32-row tiles with long K steps for
# decode-sized M, where the kernel streams B and the only goal is enough programs in flight to saturate HBM.
_LARGE = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 32, 4, 4), (64, 128, 64, 4, 4),
          (128, 64, 64, 4, 4), (64, 64, 64, 5, 4)]
_SMALL_M = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4),
            (16, 32, 256, 4, 2), (64, 64, 64, 4, 4)]
_TMA = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
        (128, 64, 64, 4, 4)]
# Split-K for decode-sized M (the `splitk` variant): the grid is N-tiles x splits, so tile shapes no longer
# have to buy parallelism and can be chosen for the weight stream alone: narrow N tiles with long K steps
# and deep pipelines. Every entry keeps stages * (BM*BK + BK*BN) * 2 bytes of operand buffers within the
# 101,376 B an sm_89 block may use (a test checks the list), and all of them are timed when autotuning:
# the space follows the Triton persistent-matmul tutorial's (tile x BLOCK_K x stages x warps) at decode size.
_SPLIT_K = [(16, 64, 128, 4, 4), (16, 32, 256, 4, 2), (16, 64, 256, 2, 4), (16, 128, 64, 4, 4),
            (16, 64, 64, 6, 4), (16, 32, 128, 5, 2), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4),
            (32, 32, 128, 5, 2), (16, 128, 128, 2, 8)]
SPLIT_K_SMEM_LIMIT = 101376
SPLIT_K_GRANULE = 128  # every split's K range is a multiple of this (16-byte aligned starts)
SPLIT_K_MAX = 16
# One small fixed config for the interpreter (every program costs ~2 ms there).
INTERPRETER_CONFIG = (32, 32, 32, 1, 4)


def _pointer_configs():
    return [_cfg(*c) for c in _LARGE + _SMALL_M]


def _set_tma_blocks(nargs):
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bk, bm] if nargs["A_TRANSPOSED"] else [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_TRANSPOSED"] else [bk, bn]
    nargs["c_desc"].block_shape = [bm, bn]


def _tma_configs():
    return [_cfg(*c, pre_hook=_set_tma_blocks) for c in _TMA]


# ----------------------------------------------------------------------------------------- shared memory
def config_shared_bytes(bm: int, bn: int, bk: int, stages: int, elem_bytes: int = 2) -> int:
    """An upper bound of the shared memory a config of these kernels allocates: per pipeline stage an A and a
    B tile and an 8-byte mbarrier, or the fp32 accumulator tile the epilogue may stage, whichever is larger
    (the epilogue reuses the pipeline's buffers). Triton 3.9 allocates exactly the stage buffers on sm_90 and
    one stage fewer on sm_80/89; test_shared_memory.py checks the bound against Triton's own count."""
    return max(stages * ((bm * bk + bk * bn) * elem_bytes + 8), bm * bn * 4)


def fit_shared_memory(configs: list, limit_bytes: int) -> list:
    """The triton.Configs of `configs` that fit `limit_bytes` of shared memory per block, in order."""
    return [c for c in configs if config_shared_bytes(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"],
                                                      c.num_stages) <= limit_bytes]


@functools.lru_cache(maxsize=None)
def device_shared_memory(device_index: int) -> int:
    """Shared memory one block may use on this GPU (opt-in maximum): 101376 B on an L4, 232448 B on an H100."""
    limit = getattr(torch.cuda.get_device_properties(device_index), "shared_memory_per_block_optin", None)
    if limit:
        return int(limit)
    from triton.runtime import driver

    return int(driver.active.utils.get_device_properties(device_index)["max_shared_mem"])


def _prune_by_m(configs, named_args, **_):
    """Keep configs that fit this GPU's shared memory and whose row tile suits M: small tiles for decode-sized
    M, large ones otherwise."""
    configs = fit_shared_memory(configs, device_shared_memory(torch.cuda.current_device()))
    m = named_args["M"]
    if m <= 32:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] <= 32]
    elif m <= 128:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] <= 64 or (m > 64 and c.kwargs["BLOCK_N"] <= 128)]
    else:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] >= 64]
    if _autotune_enabled():
        return keep[:3] or configs[:1]
    return (keep or configs)[:1]


def _prune_splitk(configs, named_args, **_):
    """Every split-K config is timed (the list is short and built for decode); M > 16 drops the 16-row
    tiles, which would read the weight stream twice."""
    keep = [c for c in configs if named_args["M"] <= 16 or c.kwargs["BLOCK_M"] >= 32] or configs
    return keep if _autotune_enabled() else keep[:1]


def splitk_plan(M: int, N: int, K: int, programs: int, granule: int = SPLIT_K_GRANULE) -> tuple[int, int]:
    """(splits, K per split) so that about `programs` CTAs run (counting 64-column, 32-row tiles), each
    split at least two granules of K long; splits 1 means no reduction pass."""
    tiles = triton.cdiv(N, 64) * triton.cdiv(M, 32)
    k_granules = triton.cdiv(K, granule)
    splits = 1
    while splits < SPLIT_K_MAX and tiles * splits < programs and k_granules >= 4 * splits:
        splits *= 2
    k_per_split = triton.cdiv(k_granules, splits) * granule
    return triton.cdiv(K, k_per_split), k_per_split  # no empty split


def _autotune_enabled() -> bool:
    """KERNEL_LAB_GEMM_AUTOTUNE=0 picks the first pruned config without timing (fast start-up)."""
    return os.environ.get("KERNEL_LAB_GEMM_AUTOTUNE", "1") != "0"


def _bench_config(fn, quantiles=None):
    # Short timing per candidate: config choice needs ranking, not precision.
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


_KEYS = ["M_BUCKET", "N", "K", "LAYOUT"]


@functools.lru_cache(maxsize=None)
def _autotuned(kind: str):
    """Autotuned wrappers, built on first CUDA use (the interpreter path launches the raw kernels)."""
    common = dict(key=_KEYS, prune_configs_by={"early_config_prune": _prune_by_m}, do_bench=_bench_config)
    if kind == "tiled":
        return triton.autotune(configs=_pointer_configs(), **common)(_matmul_kernel)
    if kind == "persistent":
        return triton.autotune(configs=_pointer_configs(), **common)(_matmul_persistent_kernel)
    if kind == "tma":
        return triton.autotune(configs=_tma_configs(), **common)(_matmul_tma_kernel)
    if kind == "splitk":
        return triton.autotune(configs=[_cfg(*c) for c in _SPLIT_K], key=_KEYS + ["K_PER_SPLIT"],
                               do_bench=_bench_config,
                               prune_configs_by={"early_config_prune": _prune_splitk})(_matmul_splitk_kernel)
    raise ValueError(kind)


# --------------------------------------------------------------------------------------------- dispatch
def _m_bucket(m: int) -> int:
    return min(triton.next_power_of_2(max(m, 1)), 8192)


def _layout_key(a, b) -> int:
    return (2 if a.stride(1) == 1 else 0) + (1 if b.stride(1) == 1 else 0)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tma_view(t: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """(2-D view with unit last stride, transposed?) satisfying TMA's rules, or None."""
    elem = t.element_size()
    if t.data_ptr() % 16:
        return None
    for view, transposed in ((t, False), (t.t(), True)):
        if view.stride(1) == 1 and (view.stride(0) * elem) % 16 == 0 and view.stride(0) >= view.shape[1]:
            return view, transposed
    return None


def tma_supported(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """True when the sm_90 TMA path can take these operands as they are."""
    if TensorDescriptor is None or not a.is_cuda or torch.cuda.get_device_capability(a.device)[0] < 9:
        return False
    c_ok = _tma_view(out)
    return (_tma_view(a) is not None and _tma_view(b) is not None and c_ok is not None and not c_ok[1])


def _launch_pointer(kind, a, b, c, upcast):
    M, K = a.shape
    N = b.shape[1]
    args = (a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
            _m_bucket(M), _layout_key(a, b))
    if not a.is_cuda:  # interpreter: one fixed small config, no autotuning
        bm, bn, bk, stages, warps = INTERPRETER_CONFIG
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
        meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4, UPCAST=upcast, num_warps=warps,
                    num_stages=stages)
        if kind == "persistent":
            programs = min(tiles, 3)  # fewer programs than tiles, so the stride loop is exercised
            _matmul_persistent_kernel[(programs,)](*args, NUM_PROGRAMS=programs, **meta)
        else:
            _matmul_kernel[(tiles,)](*args, **meta)
        return
    if kind == "persistent":
        sms = _num_sms(a.device.index if a.device.index is not None else torch.cuda.current_device())

        def grid(meta):
            return (min(sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)

        # The tile stride is the SM count; when there are fewer tiles than SMs the grid shrinks to the tile
        # count and every program takes exactly one tile, so the stride never skips work.
        _autotuned("persistent")[grid](*args, NUM_PROGRAMS=sms, UPCAST=upcast)
        return

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _autotuned("tiled")[grid](*args, UPCAST=upcast)


def _launch_tma(a, b, c, upcast):
    M, K = a.shape
    N = b.shape[1]
    a_view, a_t = _tma_view(a)
    b_view, b_t = _tma_view(b)
    c_view, _ = _tma_view(c)
    placeholder = [16, 16]  # the autotuner's pre_hook sets the real block shapes
    if a.is_cuda:
        descs = [TensorDescriptor.from_tensor(v, placeholder) for v in (a_view, b_view, c_view)]
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
        _autotuned("tma")[grid](*descs, M, N, K, _m_bucket(M), _layout_key(a, b),
                                A_TRANSPOSED=a_t, B_TRANSPOSED=b_t, UPCAST=upcast)
        return
    bm, bn, bk, stages, warps = INTERPRETER_CONFIG
    a_desc = TensorDescriptor.from_tensor(a_view, [bk, bm] if a_t else [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b_view, [bn, bk] if b_t else [bk, bn])
    c_desc = TensorDescriptor.from_tensor(c_view, [bm, bn])
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    _matmul_tma_kernel[(tiles,)](a_desc, b_desc, c_desc, M, N, K, _m_bucket(M), _layout_key(a, b),
                                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4, A_TRANSPOSED=a_t,
                                 B_TRANSPOSED=b_t, UPCAST=upcast, num_warps=warps, num_stages=stages)


SPLIT_K_REDUCE_BLOCK = 256  # 2 warps x 4 fp32: one 16-byte load per thread and split, many CTAs at M = 1


def splitk_shape(M: int, N: int, K: int, device: torch.device) -> tuple[int, int]:
    """(splits, K per split) the `splitk` variant launches with on `device`."""
    if device.type == "cuda":  # about two CTAs per SM
        return splitk_plan(M, N, K, 2 * _num_sms(device.index if device.index is not None
                                                  else torch.cuda.current_device()))
    # interpreter: up to three splits of whole 32-wide K blocks, so every split boundary is exercised
    bk = INTERPRETER_CONFIG[2]
    k_per_split = triton.cdiv(triton.cdiv(K, bk), 3) * bk
    return triton.cdiv(K, k_per_split), k_per_split


def _launch_splitk(a, b, c, upcast):
    M, K = a.shape
    N = b.shape[1]
    splits, k_per_split = splitk_shape(M, N, K, a.device)
    if splits == 1:  # one K range: the partial is the result, stored straight into C
        ws, ws_strides = c, (0, c.stride(0), c.stride(1))
    else:
        ws = torch.empty((splits, M, N), dtype=torch.float32, device=a.device)
        ws_strides = ws.stride()
    args = (a, b, ws, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), *ws_strides, k_per_split,
            _m_bucket(M), _layout_key(a, b))
    if a.is_cuda:
        def grid(meta):
            return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), splits)

        _autotuned("splitk")[grid](*args, UPCAST=upcast)
    else:
        bm, bn, bk, stages, warps = INTERPRETER_CONFIG
        _matmul_splitk_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn), splits)](
            *args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4, UPCAST=upcast, num_warps=warps,
            num_stages=stages)
    if splits > 1:
        _splitk_reduce_kernel[(M, triton.cdiv(N, SPLIT_K_REDUCE_BLOCK))](
            ws, c, N, splits, ws.stride(0), c.stride(0), c.stride(1), BLOCK=SPLIT_K_REDUCE_BLOCK, num_warps=2)


def bytes_moved(M: int, N: int, K: int, element_size: int = 2, splits: int = 1) -> int:
    """DRAM bytes one call must move at least: A and B read once, C written once; with `splits` > 1 the
    fp32 partials are written once and read back once by the reduction. (Tiles re-read operands, but from
    L2 when the raster order works.) The benchmark's GB/s and the README's estimates use this."""
    partials = 2 * splits * M * N * 4 if splits > 1 else 0
    return (M * K + K * N + M * N) * element_size + partials


def choose_variant(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> str:
    """The Triton kernel `variant="auto"` runs: TMA + wgmma on sm_90 when the operands allow it and M
    fills a warpgroup tile, otherwise the autotuned tiled kernel."""
    if a.is_cuda and a.shape[0] > 64 and tma_supported(a, b, out):
        return "tma"
    return "tiled"


def _validate(a, b, out, backend, variant):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    check_tensor("a", a, dtypes=HALF_DTYPES, ndim=2)
    check_tensor("b", b, dtypes=HALF_DTYPES, ndim=2)
    if b.dtype != a.dtype:
        raise TypeError(f"b must have a's dtype {str(a.dtype).replace('torch.', '')}, got "
                        f"{str(b.dtype).replace('torch.', '')}")
    if b.shape[0] != a.shape[1]:
        raise ValueError(f"b must have shape ({a.shape[1]}, N) to match a's K = {a.shape[1]}, "
                         f"got {tuple(b.shape)}")
    check_same_device(a=a, b=b, out=out)
    if out is not None:
        check_tensor("out", out, dtypes=(a.dtype,), ndim=2)
        if tuple(out.shape) != (a.shape[0], b.shape[1]):
            raise ValueError(f"out must have shape {(a.shape[0], b.shape[1])}, got {tuple(out.shape)}")


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, backend: str = "triton", *,
           variant: str = "auto") -> torch.Tensor:
    """C = A @ B for fp16/bf16 A [M, K] and B [K, N] of any strides, accumulated in fp32, returned in the
    input dtype (in `out` when given).

    backend: "triton" or "cute" (CuTe DSL, CUDA only; CPU tensors take the reference path).
    variant (Triton only): "auto", "tiled", "persistent", "tma" (sm_90+ and TMA-compatible operands) or
    "splitk" (K split over several CTAs and reduced in a second pass; built for decode-sized M).
    Follows the dispatch rule in common.py: CUDA runs the kernel, CPU the reference unless TRITON_INTERPRET=1.
    """
    _validate(a, b, out, backend, variant)
    M, K = a.shape
    N = b.shape[1]
    result = out if out is not None else torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return result
    if K == 0:
        return result.zero_()
    if backend == "cute":
        if not a.is_cuda:  # the DSL has no CPU execution; keep the contract with the reference
            return result.copy_(matmul_reference(a, b))
        try:
            from .gemm_cute import matmul_cute
        except ImportError as exc:
            raise RuntimeError("backend='cute' needs the nvidia-cutlass-dsl package (`import cutlass`): "
                               f"{exc}") from exc
        return matmul_cute(a, b, result)
    if not use_triton(a):
        return result.copy_(matmul_reference(a, b))
    upcast = interpreter_active() and a.dtype == torch.bfloat16
    if variant == "auto":
        variant = choose_variant(a, b, result)
    if variant == "tma":
        if TensorDescriptor is None or (a.is_cuda and torch.cuda.get_device_capability(a.device)[0] < 9):
            raise ValueError("variant='tma' needs triton's TensorDescriptor and an sm_90+ GPU")
        c_view = _tma_view(result)
        if _tma_view(a) is None or _tma_view(b) is None or c_view is None or c_view[1]:
            raise ValueError("variant='tma' needs 16-byte-aligned operands with one unit stride each and a "
                             "row-major out")
        _launch_tma(a, b, result, upcast)
    elif variant == "splitk":
        _launch_splitk(a, b, result, upcast)
    else:
        _launch_pointer(variant, a, b, result, upcast)
    return result


# --------------------------------------------------------------------------------------------- AOT specs
def compile_specs():
    """Specialisations compiled for sm_80/89/90 by the compile tests: one per kernel and layout family."""
    from .gemm_specs import compile_specs as specs

    return specs()


def dispatch_config_specs():
    """Every config the dispatcher may launch on each target, compiled for their metadata only."""
    from .gemm_specs import dispatch_config_specs as specs

    return specs()
