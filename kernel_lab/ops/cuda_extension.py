"""Build and call the CUDA C++ extension of projects 04/05 (kernel_lab/csrc).

The extension is compiled on first use with `torch.utils.cpp_extension.load` (ninja), for the current
GPU's architecture, into a cache directory keyed by the sources' hash and torch's version; it needs a CUDA
build of torch and nvcc. `python -m kernel_lab.ops.cuda_extension` builds it ahead of time (tools/gpu_suite.sh
does this once, first). CPU-only torch cannot build it: the CPU path of every op is the PyTorch reference or
a C kernel, and the kernels themselves are compiled without torch by the compile tests (`kernel_sources()`
are torch-free).

A cached build is imported directly, without torch's builder: `load` checks for ninja in every new process
even when nothing is left to build, and the validation box may have no ninja. Before a build,
`missing_build_tools` says in one line everything the machine lacks (ninja, a C++ compiler, nvcc, an nvcc of
torch's CUDA major version, one that knows the GPU's architecture); `unavailable_reason()` gives that line to
the tests (the root conftest skips tests marked `cuda_extension` with it) and the suite (which skips the
steps that need the extension). The build is always for the GPU in use: a preset TORCH_CUDA_ARCH_LIST is
overridden for the build, with a warning, since it may lack this GPU or name architectures nvcc 13 no longer
builds (anything below sm_75).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# Torch-free kernel sources (compiled standalone by nvcc in the compile tests) and the torch binding.
KERNEL_SOURCES = ("paged_attention.cu", "kv_cache.cu")
HEADERS = ("kernel_common.cuh", "paged_kernels.h")
BINDING_SOURCE = "bindings.cpp"


def kernel_sources() -> list[Path]:
    return [CSRC / name for name in KERNEL_SOURCES]


# `python -m kernel_lab.ops.cuda_extension` exits with this when a build tool is missing (any other failure: 1).
TOOLS_MISSING_EXIT = 3
# Set by tools/gpu_suite.sh to the build step's one line when that build failed: later processes then skip
# the extension at once instead of each rebuilding it under its own step's cap.
UNAVAILABLE_ENV = "KERNEL_LAB_EXTENSION_UNAVAILABLE"


class ExtensionUnavailable(RuntimeError):
    """The extension is neither cached nor buildable on this machine; the message is one line."""


def _source_hash() -> str:
    """The build's cache key: the sources, and the torch they are compiled against (a build for another torch
    would import and then fail, or crash, on an ABI mismatch)."""
    digest = hashlib.sha256(f"{torch.__version__} {torch.version.cuda}".encode())
    for name in (*KERNEL_SOURCES, *HEADERS, BINDING_SOURCE):
        digest.update((CSRC / name).read_bytes())
    return digest.hexdigest()[:12]


def find_nvcc() -> str | None:
    """nvcc as torch's extension builder finds it: $CUDA_HOME/bin (CUDA_HOME as torch resolves it), else PATH."""
    from torch.utils.cpp_extension import CUDA_HOME

    candidate = Path(CUDA_HOME) / "bin" / "nvcc" if CUDA_HOME else None
    return str(candidate) if candidate is not None and candidate.exists() else shutil.which("nvcc")


def nvcc_facts(nvcc: str) -> tuple[str | None, set[int]]:
    """(CUDA release "major.minor", the compute capabilities it can build, e.g. {75, 80, 89, 90})."""
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    release = re.search(r"release (\d+\.\d+)", version)
    listing = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout
    return (release.group(1) if release else None), {int(a) for a in re.findall(r"compute_(\d+)", listing)}


def find_cxx() -> str | None:
    """The host C++ compiler torch's extension builder calls: $CXX, else c++."""
    return shutil.which(os.environ.get("CXX", "c++"))


def missing_build_tools(capability: tuple[int, int], torch_cuda: str | None, ninja: bool, nvcc: str | None,
                        nvcc_release: str | None, nvcc_archs: set[int], cxx: str | None = "c++") -> list[str]:
    """What the extension build lacks on this machine, one short phrase each (empty: nothing)."""
    arch = capability[0] * 10 + capability[1]
    missing = []
    if torch_cuda is None:
        missing.append(f"a CUDA build of torch (this torch, {torch.__version__}, is CPU-only)")
    if not ninja:
        missing.append("ninja (torch.utils.cpp_extension builds with it): not on PATH")
    if cxx is None:
        missing.append(f"a C++ compiler (g++): ${{CXX:-c++}} = {os.environ.get('CXX', 'c++')} is not on PATH")
    if nvcc is None:
        missing.append("nvcc: neither $CUDA_HOME/bin/nvcc nor nvcc on PATH")
        return missing
    if nvcc_release is None:
        missing.append(f"a working nvcc: `{nvcc} --version` printed no release")
    elif torch_cuda is not None and nvcc_release.split(".")[0] != torch_cuda.split(".")[0]:
        missing.append(f"an nvcc of torch's CUDA major version: {nvcc} is CUDA {nvcc_release}, torch was built "
                       f"with CUDA {torch_cuda} (set CUDA_HOME to a matching toolkit)")
    if nvcc_archs and arch not in nvcc_archs:
        missing.append(f"an nvcc that builds sm_{arch} (this GPU): {nvcc} builds "
                       f"{', '.join(f'sm_{a}' for a in sorted(nvcc_archs))}")
    return missing


def unavailable_line(missing: list[str]) -> str | None:
    """missing_build_tools' list as the one line the tests and the suite print (None when nothing is missing)."""
    return "cannot build the kernel_lab CUDA extension, this machine lacks: " + "; ".join(missing) if missing else None


def check_build_tools(capability: tuple[int, int]) -> None:
    """Raise ExtensionUnavailable naming everything the build lacks, before torch's builder fails on the first."""
    from torch.utils.cpp_extension import is_ninja_available

    nvcc = find_nvcc()
    release, archs = nvcc_facts(nvcc) if nvcc else (None, set())
    line = unavailable_line(missing_build_tools(capability, torch.version.cuda, is_ninja_available(), nvcc, release,
                                                archs, find_cxx()))
    if line:
        raise ExtensionUnavailable(line)


def build_arch_list(capability: tuple[int, int], preset: str | None) -> str:
    """TORCH_CUDA_ARCH_LIST for the build: exactly the GPU in use. A different preset is overridden with a
    warning (it may lack this GPU, whose kernels would then fail to load, or name architectures nvcc 13
    dropped, which fails the build)."""
    wanted = f"{capability[0]}.{capability[1]}"
    if preset and preset.strip() != wanted:
        warnings.warn(f"TORCH_CUDA_ARCH_LIST={preset!r} ignored for the kernel_lab extension: it is built for "
                      f"the GPU in use only ({wanted})", RuntimeWarning, stacklevel=3)
    return wanted


def build_location(capability: tuple[int, int]) -> tuple[str, Path]:
    """(module name, build directory) of the extension for this source version, torch and GPU architecture."""
    name = f"kernel_lab_paged_{_source_hash()}_sm{capability[0]}{capability[1]}"
    root = os.environ.get("KERNEL_LAB_BUILD_DIR") or Path(
        os.environ.get("KERNEL_LAB_CACHE", Path.home() / ".cache" / "kernel_lab")) / "ext"
    return name, Path(root) / name


def import_cached(name: str, build_dir: Path):
    """The module of a finished earlier build, imported as torch's loader would (no ninja, no compiler);
    None when there is none. A library that does not import (a link cut short) is removed so it is rebuilt."""
    library = build_dir / f"{name}.so"
    if not library.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as exc:
        warnings.warn(f"rebuilding the kernel_lab CUDA extension: the cached {library} does not import ({exc})",
                      RuntimeWarning, stacklevel=3)
        library.unlink(missing_ok=True)
        return None
    return module


def _capability() -> tuple[int, int]:
    if os.environ.get(UNAVAILABLE_ENV):
        raise ExtensionUnavailable(os.environ[UNAVAILABLE_ENV])
    if not torch.cuda.is_available():
        raise ExtensionUnavailable("the kernel_lab CUDA extension needs a CUDA device and a CUDA build of torch")
    return torch.cuda.get_device_capability()


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> str | None:
    """Why the extension can be neither imported from the cache nor built here, in one line; None when it can
    (a cached build exists, or every build tool is present). A build can still fail after None."""
    try:
        capability = _capability()
        name, build_dir = build_location(capability)
        if (build_dir / f"{name}.so").is_file():
            return None
        check_build_tools(capability)
    except ExtensionUnavailable as exc:
        return str(exc)
    return None


_loaded: dict[str, object] = {}  # "module", or the "failure" that later calls in this process re-raise


def load_extension(verbose: bool = False):
    """Import the extension, compiling it first when no build of this source version, torch and GPU
    architecture is cached. Raises ExtensionUnavailable (one line) when a tool the build needs is missing.
    A failed build is not retried by every later call in the process."""
    if "failure" in _loaded:
        raise _loaded["failure"]
    if "module" not in _loaded:
        try:
            _loaded["module"] = _load(verbose)
        except Exception as exc:
            _loaded["failure"] = exc
            raise
    return _loaded["module"]


def _load(verbose: bool):
    capability = _capability()
    name, build_dir = build_location(capability)
    module = import_cached(name, build_dir)
    if module is not None:
        return module
    check_build_tools(capability)
    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    # torch.utils.cpp_extension derives -gencode flags from this variable: set it for the build only.
    preset = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = build_arch_list(capability, preset)
    try:
        return load(
            name=name,
            sources=[str(CSRC / BINDING_SOURCE), *(str(p) for p in kernel_sources())],
            extra_include_paths=[str(CSRC)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-lineinfo"] + (["-Xptxas=-v"] if verbose else []),
            build_directory=str(build_dir),
            verbose=verbose,
        )
    finally:
        if preset is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = preset


@functools.lru_cache(maxsize=None)
def compile_kernels(name: str, targets: tuple[int, ...] = (80, 89, 90)) -> dict:
    """nvcc-compile the torch-free `csrc/<name>.cu` for each target (in parallel, once per process).

    Returns {capability: {"registers", "spill_stores", "spill_loads", "stack_frame", "functions", "log",
    "sass", "cubin"}} from `kernel_lab.harness.compile.nvcc_compile`."""
    from concurrent.futures import ThreadPoolExecutor

    from kernel_lab.harness.compile import nvcc_compile

    source = CSRC / f"{name}.cu"
    with ThreadPoolExecutor(max_workers=len(targets)) as pool:
        futures = {cap: pool.submit(nvcc_compile, [source], cap, ["-I", str(CSRC)]) for cap in targets}
        return {cap: future.result() for cap, future in futures.items()}


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def launch_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, out,
                        sliding_window: int = 0, variant: str = "direct") -> None:
    """Plan the split from shapes (and the window) only, allocate the split workspace, launch; no host
    synchronisation."""
    from .paged_attention import DECODE_VARIANTS, plan_splits

    batch, num_q_heads, head_dim = q.shape
    plan = plan_splits(batch, num_q_heads, k_cache.shape[2], block_tables.shape[1], k_cache.shape[1],
                       num_sms(q.device), sliding_window)
    if plan.num_splits > 1:
        partial_out = torch.empty((batch, num_q_heads, plan.num_splits, head_dim), dtype=torch.float32,
                                  device=q.device)
        partial_stats = torch.empty((batch, num_q_heads, plan.num_splits, 2), dtype=torch.float32,
                                    device=q.device)
    else:
        partial_out = partial_stats = None
    load_extension().paged_decode(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, out,
                                  partial_out, partial_stats, float(scale), plan.heads_per_group,
                                  plan.partition_blocks, plan.num_splits, sliding_window or 0,
                                  DECODE_VARIANTS[variant])


def main() -> int:
    """Build (or find the cached build of) the extension; a missing tool is one line and TOOLS_MISSING_EXIT."""
    import sys

    try:
        module = load_extension(verbose=True)
    except ExtensionUnavailable as exc:
        print(exc, file=sys.stderr)
        return TOOLS_MISSING_EXIT
    print(f"built {module.__name__} from {CSRC}: {module.__file__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
