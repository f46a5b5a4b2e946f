"""Hardware ceilings and the arithmetic that turns a timing into "% of what this device can do".

Ceilings are *measured* once per device: a large device-to-device copy (bytes read + bytes written per
second) and a large bf16 `torch.matmul` (cuBLAS). They are cached per device and copied into every result
record, so a reader sees which ceiling a percentage refers to. Datasheet figures are kept beside them,
labelled as such, and never used as the denominator.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .bench import benchmark

# Datasheet peaks, for context only: (HBM/GDDR GB/s, dense bf16 tensor TFLOP/s).
DATASHEET = {
    "NVIDIA H200": (4800.0, 989.0),
    "NVIDIA H100 80GB HBM3": (3350.0, 989.0),
    "NVIDIA A100-SXM4-80GB": (2039.0, 312.0),
    "NVIDIA L4": (300.0, 121.0),
}

CACHE_DIR = Path(os.environ.get("KERNEL_LAB_CACHE", Path.home() / ".cache" / "kernel_lab"))


def _cache_key(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name}|sm{props.major}{props.minor}|torch{torch.__version__}"
    from .env import _cpu_description  # a cached ceiling must never pass from one CPU model to another

    return f"cpu|{_cpu_description()[0]}|{os.cpu_count()}|torch{torch.__version__}"


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> dict:
    n = nbytes // 4
    if device.type != "cuda":
        n = min(n, (256 << 20) // 4)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    t = benchmark(lambda: dst.copy_(src), device=device, warmup=5, rep=30, flush_l2=False, cuda_graph=False)
    moved = 2 * src.numel() * src.element_size()
    return {"GBps": moved / (t.median_ms * 1e-3) / 1e9, "method": f"copy_ of {moved // 2 >> 20} MiB fp32, "
            "bytes read + written over the median time", "timing": t.to_dict()}


def measure_read_bandwidth(threads: int, nbytes: int = 512 << 20) -> dict:
    """CPU bytes read per second by `threads` threads: a sum over a float32 buffer far larger than the caches.
    A decode step mostly reads (its weights) and writes little, so this, not the copy (which spends half its
    traffic writing), bounds a step's weight-read rate; it depends on the thread count, so it is measured per
    count, uncached."""
    src = torch.randn(nbytes // 4)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t = benchmark(lambda: src.sum(), device=torch.device("cpu"), warmup=3, rep=15, flush_l2=False,
                      cuda_graph=False)
    finally:
        torch.set_num_threads(previous)
    return {"GBps": src.numel() * 4 / (t.median_ms * 1e-3) / 1e9, "threads": threads,
            "method": f"sum of {nbytes >> 20} MiB fp32 with {threads} thread(s), bytes read over the median time",
            "timing": t.to_dict()}


def measure_matmul_tflops(device: torch.device, n: int = 8192) -> dict:
    dtype = torch.bfloat16
    if device.type != "cuda":
        n, dtype = 1024, torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = benchmark(lambda: torch.matmul(a, b), device=device, warmup=5, rep=20, flush_l2=False, cuda_graph=False)
    return {"TFLOPs": 2 * n**3 / (t.median_ms * 1e-3) / 1e12, "method": f"torch.matmul {n}x{n}x{n} "
            f"{str(dtype).replace('torch.', '')}", "timing": t.to_dict()}


def ceilings(device: torch.device | str, refresh: bool = False) -> dict:
    """Measured copy bandwidth and matmul throughput of `device`, cached on disk."""
    device = torch.device(device)
    key = _cache_key(device)
    cache_file = CACHE_DIR / "ceilings.json"
    cache = {}
    if cache_file.exists():
        try:
            cache = json.loads(cache_file.read_text())
        except json.JSONDecodeError:
            cache = {}
    if not refresh and key in cache:
        return cache[key]
    record = {
        "device": key,
        "copy": measure_copy_bandwidth(device),
        "matmul": measure_matmul_tflops(device),
    }
    name = key.split("|")[0]
    if name in DATASHEET:
        record["datasheet"] = {"GBps": DATASHEET[name][0], "bf16_TFLOPs": DATASHEET[name][1],
                               "note": "vendor datasheet, for context; percentages use the measured values"}
    cache[key] = record
    try:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps(cache, indent=1))
    except OSError:
        pass
    return record


def achieved_gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def achieved_tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def percent_of(value: float, ceiling: float) -> float:
    return 100.0 * value / ceiling if ceiling else float("nan")
