"""Build and call the CUDA C++ extension of projects 04/05 (kernel_lab/csrc).

The extension is compiled on first use with `torch.utils.cpp_extension.load` (ninja), for the current
GPU's architecture, into a cache directory keyed by the sources' hash; it needs a CUDA build of torch and
nvcc. `python -m kernel_lab.ops.cuda_extension` builds it ahead of time (tools/gpu_suite.sh and the
projects' gpu_checks.sh do this). CPU-only torch cannot build it: the CPU path of every op is the PyTorch
reference, and the kernels themselves are compiled without torch by the compile tests
(`kernel_sources()` are torch-free).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# Torch-free kernel sources (compiled standalone by nvcc in the compile tests) and the torch binding.
KERNEL_SOURCES = ("paged_attention.cu", "kv_cache.cu")
HEADERS = ("kernel_common.cuh", "paged_kernels.h")
BINDING_SOURCE = "bindings.cpp"


def kernel_sources() -> list[Path]:
    return [CSRC / name for name in KERNEL_SOURCES]


def _source_hash() -> str:
    digest = hashlib.sha256()
    for name in (*KERNEL_SOURCES, *HEADERS, BINDING_SOURCE):
        digest.update((CSRC / name).read_bytes())
    return digest.hexdigest()[:12]


@functools.lru_cache(maxsize=None)
def load_extension(verbose: bool = False):
    """Compile (once per source version and GPU architecture) and import the extension module."""
    if not torch.cuda.is_available():
        raise RuntimeError("the kernel_lab CUDA extension needs a CUDA device and a CUDA build of torch")
    from torch.utils.cpp_extension import load

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    # torch.utils.cpp_extension derives -gencode flags from this list; only the GPU in use is built.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    name = f"kernel_lab_paged_{_source_hash()}_sm{arch}"
    build_dir = Path(os.environ.get("KERNEL_LAB_BUILD_DIR")
                     or Path(os.environ.get("KERNEL_LAB_CACHE", Path.home() / ".cache" / "kernel_lab")) / "ext") / name
    build_dir.mkdir(parents=True, exist_ok=True)
    return load(
        name=name,
        sources=[str(CSRC / BINDING_SOURCE), *(str(p) for p in kernel_sources())],
        extra_include_paths=[str(CSRC)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo"] + (["-Xptxas=-v"] if verbose else []),
        build_directory=str(build_dir),
        verbose=verbose,
    )


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


def launch_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, out) -> None:
    """Plan the split from shapes only, allocate the split workspace, launch; no host synchronisation."""
    from .paged_attention import plan_splits

    batch, num_q_heads, head_dim = q.shape
    plan = plan_splits(batch, num_q_heads, k_cache.shape[2], block_tables.shape[1], k_cache.shape[1],
                       num_sms(q.device))
    if plan.num_splits > 1:
        partial_out = torch.empty((batch, num_q_heads, plan.num_splits, head_dim), dtype=torch.float32,
                                  device=q.device)
        partial_stats = torch.empty((batch, num_q_heads, plan.num_splits, 2), dtype=torch.float32,
                                    device=q.device)
    else:
        partial_out = partial_stats = None
    load_extension().paged_decode(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, out,
                                  partial_out, partial_stats, float(scale), plan.heads_per_group,
                                  plan.partition_blocks, plan.num_splits)


if __name__ == "__main__":
    module = load_extension(verbose=True)
    print(f"built {module.__name__} from {CSRC}")
