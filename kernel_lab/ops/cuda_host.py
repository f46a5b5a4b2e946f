"""The CUDA sources of projects 04/05 (csrc/paged_attention.cu, kv_cache.cu) built as host C++ on the SIMT
runtime of csrc/simt and run on CPU, for tests: what the runtime checks and what it cannot tell you is in
kernel_lab/csrc/simt/README.md.

`build()` compiles the kernel sources, the runtime and the test driver (csrc/simt/harness.cpp) into one
executable with the system C++ compiler ($CXX, else c++/g++), cached by cpu_kernels' mechanism (one object per
translation unit keyed by its text, every header, the flags and the compiler's version). Two flavours:
`asan` (AddressSanitizer; every buffer the driver hands a kernel has poisoned margins) and `race` (the
kernel sources carry GCC's -fsanitize=thread access hooks, which feed the runtime's shared-memory race
detector; no ThreadSanitizer runtime is linked). `arch` (800 or 890) is the __CUDA_ARCH__ the kernels' arch
branches see. `mutations` patches the source text of a copy first (the mutation tests).

Two things nvcc's front end handles are not C++, and the builder rewrites them in its copy of each source:
`kernel<<<grid, block, smem, stream>>>(args)` becomes `kernel * ::simt::launch_config(grid, block, smem,
stream)(args)`, and `extern __shared__ T name[];` a pointer into the runtime's dynamic shared arena. The kernel
bodies are compiled as they are (kernel_common.cuh's inline-PTX fast_exp2 has an `#ifdef KERNEL_LAB_SIMT`
host branch).

`paged_decode` and `write_kv` take torch CPU tensors and fill the launch parameters as bindings.cpp does.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from . import cpu_kernels
from .paged_attention import DECODE_VARIANTS

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SIMT = CSRC / "simt"
KERNEL_SOURCES = ("paged_attention.cu", "kv_cache.cu", "selftest.cu")  # selftest.cu: csrc/simt
HOST_SOURCES = ("runtime.cpp", "harness.cpp")
FLAVOURS = ("asan", "race")
# -ffp-contract=off: no a*b+c fused behind the source's back (nvcc does fuse them: see the README).
COMMON_FLAGS = ("-std=c++17", "-fno-omit-frame-pointer", "-ffp-contract=off", "-Wall",
                "-Wno-unknown-pragmas", "-Wno-unused-function")
FLAVOUR_FLAGS = {"asan": ("-fsanitize=address",), "race": ("-DKL_SIMT_RACE",)}
# -O1 with ASan triples the kernel sources' compile time for little speed: the fibers' switches dominate.
KERNEL_OPT = {"asan": "-O0", "race": "-O1"}
RACE_HOOKS = ("-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0")
LINK_FLAGS = {"asan": ("-fsanitize=address",), "race": ()}
ELEM_KIND = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float8_e4m3fn: 3}


class SimtError(RuntimeError):
    """The kernel failed a check of the host runtime (AddressSanitizer, a race, a barrier or mask error)."""


def cxx_compiler() -> str | None:
    name = os.environ.get("CXX", "").strip()
    if name:
        return name if shutil.which(shlex.split(name)[0]) else None
    return next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)


def cuda_include() -> Path | None:
    """The CUDA toolkit's include directory (for cuda_fp16.h & co.), found as nvcc is, or None."""
    from .cuda_extension import find_nvcc

    nvcc = find_nvcc()
    for root in ([Path(nvcc).resolve().parent.parent] if nvcc else []) + [Path("/usr/local/cuda")]:
        if (root / "include" / "cuda_fp8.h").exists() and (root / "include" / "nv" / "target").exists():
            return root / "include"
    return None


def unavailable() -> str | None:
    """Why the host build's tests do not run here (None: they do). On a CUDA machine the kernels run on the
    device instead (the GPU suite's time is for that), unless KERNEL_LAB_CUDA_SOURCE=1."""
    if torch.cuda.is_available() and os.environ.get("KERNEL_LAB_CUDA_SOURCE") != "1":
        return "a CUDA device is present: the GPU tests run the kernels there (KERNEL_LAB_CUDA_SOURCE=1 forces these)"
    return missing_tools()


def missing_tools() -> str | None:
    """What the host build lacks here (None: nothing)."""
    if cxx_compiler() is None:
        return "no C++ compiler ($CXX, c++, g++ or clang++)"
    if cuda_include() is None:
        return "no CUDA toolkit headers (cuda_fp8.h, nv/target) next to nvcc or in /usr/local/cuda"
    return None


def host_source(text: str) -> str:
    """A CUDA source with the two non-C++ constructs rewritten (see the module docstring)."""
    text = re.sub(r"<<<(.*?)>>>", r"* ::simt::launch_config(\1)", text, flags=re.S)
    return re.sub(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s*|alignas\(\d+\)\s*)*([\w:]+(?:\s+[\w:]+)*?)\s*"
                  r"(?:__align__\(\d+\)\s*|alignas\(\d+\)\s*)*(\w+)\s*\[\s*\]\s*;",
                  r"\1* const \2 = reinterpret_cast<\1*>(::simt::dynamic_shared);", text)


def _prepared_sources(mutations: dict[str, list[tuple[str, str]]] | None) -> dict[str, str]:
    """csrc's kernel sources and headers, mutated (each (old, new) must match exactly once) and rewritten."""
    files = {p.name: p.read_text() for p in sorted(CSRC.glob("*")) if p.suffix in (".cu", ".cuh", ".h")}
    files["selftest.cu"] = (SIMT / "selftest.cu").read_text()
    for name, edits in (mutations or {}).items():
        for old, new in edits:
            if files[name].count(old) != 1:
                raise ValueError(f"mutation of {name}: {old!r} occurs {files[name].count(old)} times, not once")
            files[name] = files[name].replace(old, new)
    return {name: host_source(text) if name.endswith(".cu") else text for name, text in files.items()}


def build(flavour: str = "asan", arch: int = 890, mutations: dict[str, list[tuple[str, str]]] | None = None) -> Path:
    """The harness executable for this flavour, arch and source mutation (built unless cached)."""
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
    if arch not in (800, 890):
        raise ValueError(f"arch must be 800 or 890, got {arch}")
    reason = missing_tools()
    if reason:
        raise RuntimeError(f"the SIMT host build is unavailable: {reason}")
    cxx = cxx_compiler()
    version = cpu_kernels.compiler_version(cxx).encode()
    sources = _prepared_sources(mutations)
    headers = b"".join(f"{n}\0{t}".encode() for n, t in sources.items() if not n.endswith(".cu"))
    headers += b"".join(p.read_bytes() for p in sorted(SIMT.glob("*.h")))
    base = (*COMMON_FLAGS, *FLAVOUR_FLAGS[flavour], f"-DKL_SIMT_ARCH={arch}", "-I", str(cuda_include()),
            "-I", str(SIMT), "-include", str(SIMT / "simt.h"))

    with tempfile.TemporaryDirectory(prefix="kl-simt-") as tmp:
        src = Path(tmp)
        for name, text in sources.items():
            (src / name).write_text(text)

        def compile_one(name: str) -> Path:
            path = src / name if name in sources else SIMT / name
            kernel = name in KERNEL_SOURCES
            flags = (KERNEL_OPT[flavour] if kernel else "-O1", *base, "-I", str(src))
            if flavour == "race" and kernel:  # clang has no --param (its func-entry hooks are no-ops anyway)
                flags += RACE_HOOKS[:1] if "clang" in version.decode() else RACE_HOOKS
            language = ("-x", "c++") if name.endswith(".cu") else ()
            key = (path.read_bytes(), headers, " ".join(f for f in flags if f != str(src)).encode(), cxx.encode(),
                   version)

            def make(out: Path) -> None:
                _run([*shlex.split(cxx), *flags, *language, "-c", str(path), "-o", str(out)], cxx)

            return cpu_kernels.cached_build(cpu_kernels.cached_path(f"simt-{Path(name).stem}", key, ".o"), make)

        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            objects = list(pool.map(compile_one, (*KERNEL_SOURCES, *HOST_SOURCES)))

    def link(out: Path) -> None:
        _run([*shlex.split(cxx), *LINK_FLAGS[flavour], *map(str, objects), "-o", str(out)], cxx)

    key = (*(o.name.encode() for o in objects), " ".join(LINK_FLAGS[flavour]).encode())
    return cpu_kernels.cached_build(cpu_kernels.cached_path(f"simt-harness-{flavour}-{arch}", key, ".bin"), link)


def _run(cmd: list[str], cxx: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{cxx} failed (exit {result.returncode}): {result.stderr.strip()[-4000:]}")


# --------------------------------------------------------------------------------------------- running
def _storage_bytes(t: torch.Tensor) -> bytes:
    """The bytes from t's first element to the end of its storage (strided views keep their layout)."""
    start = t.storage_offset() * t.element_size()
    storage = t.untyped_storage()
    view = torch.empty(0, dtype=torch.uint8).set_(storage, start, (storage.nbytes() - start,), (1,))
    return view.numpy().tobytes()


def run(mode: str, tensors: dict[str, torch.Tensor], params: dict[str, int | float], *, flavour: str = "asan",
        arch: int = 890, seed: int | None = None, mutations=None) -> dict[str, torch.Tensor]:
    """Run the harness in `mode` over CPU `tensors` (their bytes, strides kept) and `params`; returns every
    tensor as the kernels left it (new tensors; the inputs are untouched). Raises SimtError when the kernel
    fails a runtime check. `seed` draws the block and fiber order (default: $KL_SIMT_SEED, else 1)."""
    exe = build(flavour, arch, mutations)
    seed = int(os.environ.get("KL_SIMT_SEED", "1")) if seed is None else seed
    with tempfile.TemporaryDirectory(prefix="kl-simt-run-") as tmp:
        lines = [f"{k} {v if isinstance(v, str) else repr(float(v)) if isinstance(v, float) else int(v)}"
                 for k, v in params.items()]
        for name, t in tensors.items():
            (Path(tmp) / f"{name}.bin").write_bytes(_storage_bytes(t))
            lines.append(f"buffer {name}")
        (Path(tmp) / "params.txt").write_text("\n".join(lines) + "\n")
        env = {**os.environ, "KL_SIMT_SEED": str(seed),
               "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:exitcode=87:allocator_may_return_null=0"}
        proc = subprocess.run([str(exe), mode, tmp], capture_output=True, text=True, timeout=600, env=env)
        if proc.returncode != 0:
            raise SimtError(f"{mode} failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
        if mode == "convert":
            return {p.stem: p.read_bytes() for p in Path(tmp).glob("*.out")}
        results = {}
        for name, t in tensors.items():
            raw = bytearray((Path(tmp) / f"{name}.out").read_bytes())
            flat = torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype) if raw else torch.empty(0, dtype=t.dtype)
            results[name] = flat.as_strided(t.shape, t.stride())
        return results


# --------------------------------------------------------------------------------------------- the two ops
def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=None, v_scale=None, *, plan,
                 out=None, sliding_window=0, variant="direct", **run_options) -> torch.Tensor:
    """launch_paged_decode on CPU tensors with `plan` (a paged_attention.SplitPlan, made with the same
    `sliding_window`), parameters as bindings.cpp sets them; `out` (poisoned by the caller) may carry strides.
    Returns the output."""
    batch, num_q_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    out = torch.full_like(q, float("nan")) if out is None else out
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens, out=out)
    if k_cache.dtype == torch.float8_e4m3fn:
        tensors.update(k_scale=k_scale, v_scale=v_scale)
    if plan.num_splits > 1:  # workspaces as cuda_extension.launch_paged_decode allocates them, poisoned
        tensors["partial_out"] = torch.full((batch, num_q_heads, plan.num_splits, head_dim), float("nan"))
        tensors["partial_stats"] = torch.full((batch, num_q_heads, plan.num_splits, 2), float("nan"))
    params = dict(q_batch_stride=q.stride(0), q_head_stride=q.stride(1), out_batch_stride=out.stride(0),
                  out_head_stride=out.stride(1), k_block_stride=k_cache.stride(0), v_block_stride=v_cache.stride(0),
                  block_table_stride=block_tables.stride(0) if block_tables.shape[1] > 0 else 0, batch=batch,
                  num_q_heads=num_q_heads, num_kv_heads=k_cache.shape[2], head_dim=head_dim, block_size=block_size,
                  log2_block_size=block_size.bit_length() - 1, heads_per_group=plan.heads_per_group,
                  head_groups=plan.head_groups, partition_blocks=plan.partition_blocks, num_splits=plan.num_splits,
                  scale=float(scale), q_is_bf16=int(q.dtype == torch.bfloat16), cache_kind=ELEM_KIND[k_cache.dtype],
                  sliding_window=sliding_window or 0, variant=DECODE_VARIANTS[variant])
    return run("decode", tensors, params, **run_options)["out"]


def write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, **run_options) -> None:
    """launch_write_kv on CPU tensors, in place, parameters as bindings.cpp sets them (the fp8 workspaces are
    poisoned: the kernels must initialise every entry they read)."""
    tensors = dict(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if k_cache.dtype == torch.float8_e4m3fn:
        tensors.update(k_scale=k_scale, v_scale=v_scale, k_scale_next=torch.full_like(k_scale, float("nan")),
                       v_scale_next=torch.full_like(v_scale, float("nan")),
                       page_leader=torch.full(k_scale.shape, -7, dtype=torch.int32))
    params = dict(key_token_stride=key.stride(0), key_head_stride=key.stride(1), value_token_stride=value.stride(0),
                  value_head_stride=value.stride(1), k_block_stride=k_cache.stride(0),
                  v_block_stride=v_cache.stride(0), num_tokens=key.shape[0], num_kv_heads=key.shape[1],
                  head_dim=key.shape[2], block_size=k_cache.shape[1], input_kind=ELEM_KIND[key.dtype],
                  cache_kind=ELEM_KIND[k_cache.dtype])
    results = run("write_kv", tensors, params, **run_options)
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        if name in tensors:
            tensors[name].copy_(results[name])
