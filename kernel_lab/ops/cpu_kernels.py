"""Plain-C CPU kernels (kernel_lab/csrc/cpu), built with the system C compiler and called through ctypes.

The sources include no torch headers, so a build takes a second or two: it happens on first use, into
`$KERNEL_LAB_CACHE/cpu` (default `~/.cache/kernel_lab/cpu`), under a name keyed by the source, the flags,
the compiler's version and the CPU (`-march=native` code is specific to the machine that built it). The
library is written to a temporary name and renamed into place, so concurrent processes (pytest-xdist,
several engine processes) never load a half-written file. `python -m kernel_lab.ops.cpu_kernels` builds it
ahead of time and prints its path.

When there is no compiler or the build fails, `load_library()` warns once and returns None and callers run
the PyTorch reference; `KERNEL_LAB_CPU_KERNELS=0` does the same on purpose (read at call time).

`KERNEL_LAB_CPU_ISA` (read by `isa()`, at call time) narrows every build below what the CPU has: `avx2` is an
AVX2 machine's build (no AVX-512, no VNNI), `scalar` the C fallback loops (no AVX at all), `native` (the
default) all this CPU has. An AVX-512 machine can so test and benchmark the paths an AVX2 one takes; such a
run emulates the ISA choice on this machine, not an AVX2 machine's clocks, caches or memory.

Each source is its own library: `paged_decode_attention.c` (float32, float16, bfloat16,
int8 or fp8 E4M3 KV pages, `KV_FORMATS`, int8 with a scale per token and 16 channels, fp8 per page; also the
engine's one-call layer attention with RoPE and the KV write; a call's context spans run on gguf_linear's
pool), `gguf_linear.c` (quantized GGUF weights, the process's one small pthread pool),
`norm_activation.c` (float32 residual-add + RMSNorm, silu_and_mul and gelu_and_mul, the CPU paths of
projects 01 and 02), `token_bitmask.c` (a grammar's packed token bitmask applied to logits, project
06), `decode_stack.c` (a decode step's decoder layers in one call) and `lora.c` (multi-LoRA's BGMV delta,
project 11, on gguf_linear's pool). All are compiled with `-fopenmp-simd` (the `omp simd` pragmas only, no
OpenMP runtime: torch ships its own, and two runtimes in one process fight over threads). Headers beside the
sources (`*.h`) are part of every build's cache key. `cached_path`/`cached_build` also cache the SIMT host
build of the CUDA sources (`cuda_host.py`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from .common import rows_view

CSRC_CPU = Path(__file__).resolve().parent.parent / "csrc" / "cpu"
SOURCE = CSRC_CPU / "paged_decode_attention.c"
GGUF_LINEAR_SOURCE = CSRC_CPU / "gguf_linear.c"
NORM_ACTIVATION_SOURCE = CSRC_CPU / "norm_activation.c"
TOKEN_BITMASK_SOURCE = CSRC_CPU / "token_bitmask.c"
DECODE_STACK_SOURCE = CSRC_CPU / "decode_stack.c"
LORA_SOURCE = CSRC_CPU / "lora.c"
# Neither extra flag is -ffast-math (no reassociation outside the `omp simd` reductions, NaN/inf kept):
# -ffp-contract=fast lets a * b + c become one FMA even where the compiler defaults to strict ISO C (GCC with
# -std=c11 turns contraction off); -fno-trapping-math promises that no code reads floating-point exception
# flags, without which GCC will not turn the exp clamp (a compare and select) into vector code and the
# softmax's exp loop stays scalar (a quarter of the kernel's time when measured).
CFLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=fast", "-fno-trapping-math", "-shared",
          "-fPIC", "-pthread")

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
# The cache dtypes the paged attention kernel reads (q and out are float32), as its kv_format numbers
# (kv_half.h's enum). int8 and fp8 pages come with float32 scales (kv_int8.h, kv_cache.scale_shape): int8's
# [num_blocks, block_size, num_kv_heads, groups], one per token and 16 channels; fp8's [num_blocks,
# num_kv_heads], one per page.
KV_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3, torch.float8_e4m3fn: 4}
_SCALED_FORMATS = (torch.int8, torch.float8_e4m3fn)

_PAGED_DECODE_ARGTYPES = [
    _ptr, _i64, _i64,                    # q, q_stride_b, q_stride_h
    _ptr, _ptr, _int, _ptr, _ptr,        # k_cache, v_cache, kv_format, k_scale, v_scale (int8; else NULL)
    _i64, _i64, _i64,                    # cache strides: block, token, head
    _ptr, _i64, _ptr,                    # block_tables, table_stride, seq_lens
    _int, _int, _int, _int, _int,        # batch, num_q_heads, num_kv_heads, head_dim, block_size
    ctypes.c_float, _int,                # scale, window (0: none)
    _ptr, _i64, _i64,                    # out, out_stride_b, out_stride_h
    _int,                                # threads (the pool's, gguf_linear's kl_parallel_for)
]

_ROPE_WRITE_ATTENTION_ARGTYPES = [
    _ptr, _i64, _ptr, _ptr, _ptr,        # qkv, qkv_stride, cos_rows, sin_rows, slots
    _ptr, _ptr, _int, _ptr, _ptr,        # k_cache, v_cache, kv_format, k_scale, v_scale (int8; else NULL)
    _i64, _i64, _i64,                    # cache strides: block, token, head
    _ptr, _i64, _ptr,                    # block_tables, table_stride, seq_lens
    _int, _int, _int, _int, _int,        # tokens, num_q_heads, num_kv_heads, head_dim, block_size
    ctypes.c_float, _int, _ptr,          # scale, window (0: none), out
    _int,                                # threads
]


def enabled() -> bool:
    return os.environ.get("KERNEL_LAB_CPU_KERNELS", "1") != "0"


# The flags after -march=native of each KERNEL_LAB_CPU_ISA value. -mno-avx512f drops every AVX-512 subset;
# AVX-VNNI is dropped too, as an AVX2 machine without it (Haswell to Zen 3) builds.
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f", "-mno-avxvnni"), "scalar": ("-mno-avx",)}
_X86 = ("x86_64", "AMD64")


def isa() -> str:
    """KERNEL_LAB_CPU_ISA, checked: one of ISA_FLAGS (default native); avx2 and scalar only on x86-64, avx2
    only where the CPU runs AVX2 code (avx2, fma, f16c)."""
    return _checked_isa(os.environ.get("KERNEL_LAB_CPU_ISA", "").strip() or "native")


@functools.lru_cache(maxsize=None)
def _checked_isa(name: str) -> str:
    if name not in ISA_FLAGS:
        raise ValueError(f"KERNEL_LAB_CPU_ISA must be one of {', '.join(ISA_FLAGS)}; got {name!r}")
    if name != "native" and platform.machine() not in _X86:
        raise ValueError(f"KERNEL_LAB_CPU_ISA={name} narrows an x86-64 build; this machine is {platform.machine()}")
    if name == "avx2" and not {"avx2", "fma", "f16c"} <= set(_cpu_flags().split()):
        raise ValueError("KERNEL_LAB_CPU_ISA=avx2 needs a CPU with avx2, fma and f16c; this one lacks some")
    return name


def compiler() -> str | None:
    """The C compiler: $CC, else `cc` on PATH (None when there is neither)."""
    name = os.environ.get("CC", "").strip() or "cc"
    return name if shutil.which(shlex.split(name)[0]) else None


def cache_dir() -> Path:
    return Path(os.environ.get("KERNEL_LAB_CACHE", Path.home() / ".cache" / "kernel_lab")) / "cpu"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86 / arm64
                    return line
    except OSError:
        pass
    return ""


def cached_path(stem: str, key_parts, suffix: str) -> Path:
    """The cache file for a build named `stem` whose inputs (bytes: sources, flags, compiler version) are
    `key_parts`."""
    digest = hashlib.sha256()
    for part in key_parts:
        digest.update(part)
        digest.update(b"\0")
    return cache_dir() / f"{stem}_{digest.hexdigest()[:16]}{suffix}"


def cached_build(path: Path, make) -> Path:
    """`path`, made by `make(tmp)` unless it exists: written under a temporary name in the same directory and
    renamed into place, so a concurrent builder or loader never sees a half-written file."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp" + path.suffix, dir=path.parent)
    os.close(fd)
    try:
        make(Path(tmp))
        os.replace(tmp, path)  # atomic: a concurrent builder's identical file just replaces this one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def compiler_version(cc: str) -> str:
    """`cc --version` (raises if it fails)."""
    return subprocess.run([*shlex.split(cc), "--version"], capture_output=True, text=True, check=True,
                          timeout=60).stdout


def library_path(cc: str, source: Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """Where the build for this source, compiler, flags and CPU lives (raises if `cc --version` fails).
    `extra_flags` follow -march=native (tests build narrower ISA variants, e.g. `-mno-avx512f`)."""
    source = SOURCE if source is None else source
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what the source includes
    return cached_path(source.stem, (source.read_bytes(), headers, " ".join(CFLAGS + tuple(extra_flags)).encode(),
                                     cc.encode(), compiler_version(cc).encode(), platform.machine().encode(),
                                     _cpu_flags().encode()), ".so")


def build(cc: str, source: Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile `source` (default: the paged decode kernel) unless this exact build is cached; returns the
    library's path."""
    source = SOURCE if source is None else source

    def make(tmp: Path) -> None:
        result = subprocess.run([*shlex.split(cc), *CFLAGS, *extra_flags, "-o", str(tmp), str(source)],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")

    return cached_build(library_path(cc, source, extra_flags), make)


# entry point -> (argtypes, restype), per library
_SIGNATURES = {
    "paged_decode_attention": {
        "kl_paged_decode_attention": (_PAGED_DECODE_ARGTYPES, ctypes.c_int),
        "kl_rope_write_paged_attention": (_ROPE_WRITE_ATTENTION_ARGTYPES, ctypes.c_int),
        "kl_paged_attention_isa": ([], ctypes.c_char_p),
        # gguf_linear's kl_parallel_for (NULL: single-threaded)
        "kl_paged_attention_use_pool": ([_ptr], None),
        "kl_paged_attention_split_tokens": ([], _int),
        # kv_format, src, n, dst
        "kl_store_kv_row": ([_int, _ptr, _i64, _ptr], None),
        # key, value, slots, tokens, k_cache, v_cache, k_scale, v_scale, strides (block, token, head),
        # num_kv_heads, head_dim, block_size
        "kl_write_kv_scaled": ([_int, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int,
                                _int], _int),
    },
    "gguf_linear": {
        # type, w, n, k, x, m, ldx, y, ldy, threads
        "kl_gguf_linear": ([_int, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _int], ctypes.c_int),
        # x, m, k, ldx, q, d, s
        "kl_gguf_quantize_activations": ([_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr], None),
        # type, w, k, ids, count, out
        "kl_gguf_dequantize_rows": ([_int, _ptr, _i64, _ptr, _i64, _ptr], ctypes.c_int),
        "kl_gguf_isa": ([], ctypes.c_char_p),
        # task(ctx, part, parts), ctx, parts
        "kl_parallel_for": ([_ptr, _ptr, _int], None),
        # type, rows, n, k, tiles
        "kl_gguf_pack": ([_int, _ptr, _i64, _i64, _ptr], ctypes.c_int),
    },
    "norm_activation": {
        # x, ldx, residual, ldr, weight, eps, out, ldo, residual_out, ldro, rows, h
        "kl_add_rms_norm_f32": ([_ptr, _i64, _ptr, _i64, _ptr, ctypes.c_float, _ptr, _i64, _ptr, _i64, _i64, _i64],
                                None),
        # x, ldx, out, ldo, rows, d
        "kl_silu_and_mul_f32": ([_ptr, _i64, _ptr, _i64, _i64, _i64], None),
        # x, ldx, out, ldo, rows, d, tanh_approximation
        "kl_gelu_and_mul_f32": ([_ptr, _i64, _ptr, _i64, _i64, _i64, _int], None),
    },
    "decode_stack": {
        # layers, num_layers, fns, hidden, residual, normed_first, rows, sizes, eps, scale, window, cos, sin,
        # slots, cache, block_tables, table_stride, seq_lens, threads, lora, row_slots, scratch, out_hidden,
        # out_residual
        "kl_decode_stack": ([_ptr, _int, _ptr, _ptr, _ptr, _int, _i64, _ptr, ctypes.c_float, ctypes.c_float, _int,
                             _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _int, _ptr, _ptr, _ptr, _ptr, _ptr],
                            ctypes.c_int),
    },
    "lora": {
        # y, ldy, x, ldx, rows, k, n, row_slots, num_slots, a, b, weight_format, b strides (slot, n, r), scale,
        # num_slices, rank, offsets, threads
        "kl_lora_bgmv": ([_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr, _int, _ptr, _ptr, _int, _i64, _i64, _i64,
                          _ptr, _int, _int, _ptr, _int], ctypes.c_int),
        # gguf_linear's kl_parallel_for (NULL: single-threaded)
        "kl_lora_use_pool": ([_ptr], None),
    },
    "token_bitmask": {
        # logits, elem_bytes, neg_inf_bits, row_stride, col_stride, vocab, bitmask, mask_stride, rows, n_masks
        "kl_apply_token_bitmask": ([_ptr, _int, ctypes.c_uint32, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64],
                                   ctypes.c_int),
    },
}


def _source(name: str) -> Path:
    # Read at call time, so a test can point SOURCE at another file.
    return {"paged_decode_attention": SOURCE, "gguf_linear": GGUF_LINEAR_SOURCE,
            "norm_activation": NORM_ACTIVATION_SOURCE, "token_bitmask": TOKEN_BITMASK_SOURCE,
            "decode_stack": DECODE_STACK_SOURCE, "lora": LORA_SOURCE}[name]


@functools.lru_cache(maxsize=None)
def _load(name: str = "paged_decode_attention", extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        warnings.warn("kernel_lab CPU kernels unavailable: no C compiler (cc, or $CC) on PATH; "
                      "using the PyTorch reference", RuntimeWarning, stacklevel=2)
        return None
    try:
        lib = ctypes.CDLL(str(build(cc, _source(name), extra_flags)))
        for fn_name, (argtypes, restype) in _SIGNATURES[name].items():
            fn = getattr(lib, fn_name)
            fn.argtypes = argtypes
            fn.restype = restype
        if name in ("paged_decode_attention", "lora"):  # their parts run on the projections' pool (one per process)
            pool = _load("gguf_linear", extra_flags)
            use_pool = lib.kl_paged_attention_use_pool if name == "paged_decode_attention" else lib.kl_lora_use_pool
            use_pool(ctypes.cast(pool.kl_parallel_for, ctypes.c_void_p) if pool else None)
    except Exception as exc:  # any build or load failure means: use the reference
        warnings.warn(f"kernel_lab CPU kernels unavailable ({type(exc).__name__}: {exc}); "
                      "using the PyTorch reference", RuntimeWarning, stacklevel=2)
        return None
    return lib


def load_library(name: str = "paged_decode_attention", extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The built library `name` (paged_decode_attention, gguf_linear, norm_activation, token_bitmask,
    decode_stack or lora), or
    None (disabled by KERNEL_LAB_CPU_KERNELS=0, or no compiler / failed build). `extra_flags` (after
    -march=native) replace the ones KERNEL_LAB_CPU_ISA picks."""
    if not enabled():
        return None
    return _load(name, tuple(extra_flags) or ISA_FLAGS[isa()])


def step_threads(threads: int | None = None) -> int:
    """`threads`, else the count of an enclosing `gguf_linear.kernel_threads` block, else torch's intra-op
    thread count: the threads a quantized projection may use."""
    if threads is not None:
        return max(1, int(threads))
    from . import gguf_linear  # imports this module
    return gguf_linear._step_threads or torch.get_num_threads()


def attention_threads(threads: int | None = None) -> int:
    """`threads`, else the count of an enclosing `gguf_linear.kernel_threads` block, else 1. Why not torch's
    count outside the block: there torch's own OpenMP threads run the step's GEMMs (float32 weights), and the
    pool's workers, spinning for the next call after each attention call, would take the cores from them."""
    if threads is not None:
        return max(1, int(threads))
    from . import gguf_linear  # imports this module
    return gguf_linear._step_threads or 1


def _scale_pointers(k_cache, k_scale, v_scale):
    """(k_scale, v_scale) pointers for the C calls: int8 and fp8 pages' dense float32 scales, else NULL."""
    if k_cache.dtype not in _SCALED_FORMATS:
        return None, None
    return k_scale.data_ptr(), v_scale.data_ptr()


def paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale: float,
                               out: torch.Tensor, window: int = 0, library: ctypes.CDLL | None = None,
                               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                               threads: int | None = None) -> bool:
    """Run the C kernel into `out` if it applies; False (nothing written) means: use the reference.

    Inputs are assumed validated (`paged_attention._validate` and the table value checks; the kernel reads
    whatever the tables point at): it applies to CPU float32 q and out, caches of one KV_FORMATS dtype, each
    contiguous in its last dimension, K and V with the same strides, int32 tables and lengths; int8 and fp8
    caches with their contiguous float32 `k_scale`, `v_scale` (kv_cache.scale_shape). `window` > 0:
    sliding-window attention over each sequence's last `window` tokens (0: the whole sequence). `library`:
    a build to run instead of the default one (the tests' narrowed ISA builds). `threads`: at most this many
    of the pool's threads (default `attention_threads()`); the result is the same bits for any count.
    """
    tensors = (q, k_cache, v_cache, out)
    if any(t.device.type != "cpu" or t.stride(-1) != 1 for t in tensors):
        return False
    if q.dtype != torch.float32 or out.dtype != torch.float32 or k_cache.dtype not in KV_FORMATS:
        return False
    if (k_cache.dtype != v_cache.dtype or k_cache.stride() != v_cache.stride() or block_tables.dtype != torch.int32
            or seq_lens.dtype != torch.int32):
        return False
    if k_cache.dtype in _SCALED_FORMATS and not all(s is not None and s.dtype == torch.float32
                                                    and s.is_contiguous() and s.device.type == "cpu"
                                                    for s in (k_scale, v_scale)):
        return False
    lib = library or load_library()
    if lib is None:
        return False
    # Contiguous int32 copies if needed; the locals keep every tensor alive for the duration of the call.
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    status = lib.kl_paged_decode_attention(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), KV_FORMATS[k_cache.dtype],
        *_scale_pointers(k_cache, k_scale, v_scale), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        batch, num_q_heads, num_kv_heads, head_dim, block_size, scale, window,
        out.data_ptr(), out.stride(0), out.stride(1), attention_threads(threads))
    return status == 0


def rope_write_paged_attention_cpu(qkv, cos_rows, sin_rows, slots, k_cache, v_cache, block_tables, seq_lens,
                                   num_q_heads: int, scale: float, out: torch.Tensor, window: int = 0,
                                   library: ctypes.CDLL | None = None, k_scale: torch.Tensor | None = None,
                                   v_scale: torch.Tensor | None = None, threads: int | None = None) -> None:
    """One layer's attention for a CPU step whose every row decodes (kl_rope_write_paged_attention):
    RoPE on q and k, K and V into the cache at `slots` (rounded to nearest even into 16-bit pages; into
    int8 pages with each row's own scales (one per 16 channels), or fp8 pages under project 05's page-scale
    policy, one token after another, each row attending after its own write), attention into `out`
    [tokens, num_q_heads * head_dim], over each row's last `window` tokens when `window` > 0. `library`: as
    paged_decode_attention_cpu's; `k_scale`, `v_scale`: int8 and fp8 pages'; `threads`: as paged_decode_attention_cpu's.

    No checks: the caller holds what `models/attention.py` documents (float32 activations, a KV_FORMATS
    cache, qkv and out dense rows, cos/sin rows contiguous, tables and slots checked once for the step, the
    library loaded)."""
    lib = library or load_library()
    if lib is None:
        raise RuntimeError("the CPU kernels are unavailable (disabled by KERNEL_LAB_CPU_KERNELS=0, or the "
                           "build failed): the fused CPU decode attention has no reference fallback")
    tokens = qkv.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    status = lib.kl_rope_write_paged_attention(
        qkv.data_ptr(), qkv.stride(0), cos_rows.data_ptr(), sin_rows.data_ptr(), slots.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), KV_FORMATS[k_cache.dtype], *_scale_pointers(k_cache, k_scale, v_scale),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
        tokens, num_q_heads, num_kv_heads, head_dim, block_size, scale, window, out.data_ptr(),
        attention_threads(threads))
    if status == -2:
        raise ValueError(f"kl_rope_write_paged_attention: {k_cache.dtype} pages need their k_scale and v_scale")
    if status != 0:
        raise MemoryError("kl_rope_write_paged_attention could not allocate its scratch buffer")


def write_kv_scaled_cpu(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                        library: ctypes.CDLL | None = None) -> None:
    """float32 key/value [tokens, num_kv_heads, head_dim] into int8 or fp8 pages at `slot_mapping`, one token
    after another (kl_write_kv_scaled: the fused call's write). Unchecked; the tests hold it to kv_cache's
    reference."""
    lib = library or load_library()
    key, value, slots = key.float().contiguous(), value.float().contiguous(), slot_mapping.contiguous()
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    status = lib.kl_write_kv_scaled(KV_FORMATS[k_cache.dtype], key.data_ptr(), value.data_ptr(), slots.data_ptr(),
                                    slots.numel(), k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(),
                                    v_scale.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                    num_kv_heads, head_dim, block_size)
    if status == -1:
        raise MemoryError("kl_write_kv_scaled: no scratch memory for an int8 K row's rotation")
    if status != 0:
        raise ValueError(f"kl_write_kv_scaled: {k_cache.dtype} pages have no page scales (int8 or fp8 only)")


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` as float32 CPU rows [R, H] with unit stride in H, without copying; None where it is not that."""
    if t is None or not t.is_cpu or t.dtype != torch.float32:  # is_cpu: the cheap test
        return None
    return rows_view(t, unit_stride=True)


def add_rms_norm_cpu(x, residual, weight, eps: float, out, residual_out) -> bool:
    """out = rms_norm(x [+ residual]) * weight, and residual_out = x + residual when residual is given, by
    the C kernel; False (nothing written) means: use the reference. Shapes are the caller's to check; all
    tensors must be float32 on the CPU, each viewable as rows with unit stride (weight contiguous)."""
    x2, out2 = _rows(x), _rows(out)
    r2, ro2 = (_rows(residual), _rows(residual_out)) if residual is not None else (None, None)
    if x2 is None or out2 is None or (residual is not None and (r2 is None or ro2 is None)):
        return False
    if weight.dtype != torch.float32 or not weight.is_cpu or not weight.is_contiguous():
        return False
    lib = load_library("norm_activation")
    if lib is None:
        return False
    rows, h = x2.shape
    lib.kl_add_rms_norm_f32(x2.data_ptr(), x2.stride(0), 0 if r2 is None else r2.data_ptr(),
                            0 if r2 is None else r2.stride(0), weight.data_ptr(), eps, out2.data_ptr(),
                            out2.stride(0), 0 if ro2 is None else ro2.data_ptr(), 0 if ro2 is None else ro2.stride(0),
                            rows, h)
    return True


def add_rms_norm_decode(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) for a fused CPU decode step's dense float32 rows
    [T, H], by kl_add_rms_norm_f32. No checks, as rope_write_paged_attention_cpu: between a step's
    projections the interpreter runs with cold caches, and ops.fused_add_rms_norm's checks and views took
    about 80 us a call there, a norm's C work a microsecond."""
    out, new_residual = torch.empty_like(x), torch.empty_like(x)
    rows, h = x.shape
    load_library("norm_activation").kl_add_rms_norm_f32(
        x.data_ptr(), h, residual.data_ptr(), h, weight.data_ptr(), eps, out.data_ptr(), h,
        new_residual.data_ptr(), h, rows, h)
    return out, new_residual


def silu_and_mul_decode(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] for a fused CPU decode step's dense float32 rows [T, 2d], unchecked (as
    add_rms_norm_decode)."""
    rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, d, dtype=x.dtype)
    load_library("norm_activation").kl_silu_and_mul_f32(x.data_ptr(), 2 * d, out.data_ptr(), d, rows, d)
    return out


def gated_activation_cpu(x, out, activation: str) -> bool:
    """out [.., d] = activation(x[.., :d]) * x[.., d:] by the C kernel, activation "silu", "gelu" or
    "gelu_tanh"; False (nothing written) means: use the reference. float32 CPU rows with unit stride;
    shapes are the caller's to check."""
    x2, out2 = _rows(x), _rows(out)
    if x2 is None or out2 is None:
        return False
    lib = load_library("norm_activation")
    if lib is None:
        return False
    args = (x2.data_ptr(), x2.stride(0), out2.data_ptr(), out2.stride(0), out2.shape[0], out2.shape[1])
    if activation == "silu":
        lib.kl_silu_and_mul_f32(*args)
    else:
        lib.kl_gelu_and_mul_f32(*args, int(activation == "gelu_tanh"))
    return True


# the bit pattern of -inf in each logits dtype the bitmask kernel writes
_NEG_INF_BITS = {torch.float32: 0xFF800000, torch.float16: 0xFC00, torch.bfloat16: 0xFF80}


def apply_token_bitmask_cpu(logits, bitmask, rows) -> bool:
    """logits[rows[i], j] = -inf where bit j of bitmask[i] is 0, in place, by the C kernel; False (nothing
    written) means: use the reference. Inputs are assumed validated (`token_bitmask._validate`, row numbers
    in range): CPU logits [B, V] fp32/fp16/bf16 with any strides, int32 bitmask rows with unit stride,
    `rows` an int64 tensor of bitmask.shape[0] row numbers or None (bitmask row i masks logits row i)."""
    if logits.dtype not in _NEG_INF_BITS or not logits.is_cpu:
        return False
    lib = load_library("token_bitmask")
    if lib is None:
        return False
    rows = None if rows is None else rows.to(torch.int64).contiguous()  # kept alive for the call
    status = lib.kl_apply_token_bitmask(
        logits.data_ptr(), logits.element_size(), _NEG_INF_BITS[logits.dtype], logits.stride(0), logits.stride(1),
        logits.shape[1], bitmask.data_ptr(), bitmask.stride(0), 0 if rows is None else rows.data_ptr(),
        bitmask.shape[0])
    return status == 0


def main() -> None:
    if not enabled():
        raise SystemExit("KERNEL_LAB_CPU_KERNELS=0: the CPU kernels are disabled")
    cc = compiler()
    if cc is None:
        raise SystemExit("no C compiler: set $CC or put cc on PATH")
    for name in _SIGNATURES:
        print(build(cc, _source(name), ISA_FLAGS[isa()]))


if __name__ == "__main__":
    main()
