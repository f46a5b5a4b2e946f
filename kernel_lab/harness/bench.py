"""Timing: CUDA events with an L2 flush, a CUDA-graph mode for short kernels, and a CPU fallback.

Every number a benchmark prints comes from `benchmark()`, so every project is timed the same way:
warm up, then time each call separately, then report quantiles (median, p20, p80, min) rather than a
mean that one preempted call can drag.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

# Kernels faster than this are dominated by launch overhead when launched one at a time; in "auto" mode
# they are re-timed as a batch of calls replayed from one CUDA graph.
GRAPH_THRESHOLD_MS = 0.010
CALLS_PER_GRAPH = 20


@dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    min_ms: float
    samples: int
    method: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def quantile(sorted_values: list[float], q: float) -> float:
    """The q-quantile (q in [0, 1]) of sorted values, interpolating linearly between closest ranks (numpy's
    default)."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples_ms: Sequence[float], method: dict) -> Timing:
    s = sorted(samples_ms)
    return Timing(
        median_ms=statistics.median(s),
        p20_ms=quantile(s, 0.2),
        p80_ms=quantile(s, 0.8),
        min_ms=s[0],
        samples=len(s),
        method=method,
    )


@contextlib.contextmanager
def nvtx_range(name: str | None):
    """Label a benchmarked case in Nsight Systems timelines (no-op without the nvtx package)."""
    if not name:
        yield
        return
    try:
        import nvtx
    except ImportError:
        yield
        return
    with nvtx.annotate(name):
        yield


_flush_buffer: torch.Tensor | None = None


def _l2_flush_buffer(device: torch.device) -> torch.Tensor:
    """A buffer larger than any current L2 (H200: 60 MiB), zeroed before each timed call."""
    global _flush_buffer
    if _flush_buffer is None or _flush_buffer.device != device:
        props = torch.cuda.get_device_properties(device)
        l2 = getattr(props, "L2_cache_size", 64 << 20) or (64 << 20)
        _flush_buffer = torch.empty(max(4 * l2, 256 << 20), dtype=torch.uint8, device=device)
    return _flush_buffer


def _time_events(fns: Sequence[Callable], warmup: int, rep: int, flush_l2: bool, device) -> list[float]:
    flush = _l2_flush_buffer(device) if flush_l2 else None
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for i in range(rep):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        fns[i % len(fns)]()
        ends[i].record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _time_graph(fns: Sequence[Callable], warmup: int, rep: int, device) -> list[float]:
    """Capture CALLS_PER_GRAPH calls (rotating over `fns`) into one graph; a sample is replay time / calls."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for i in range(3):
            fns[i % len(fns)]()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            fns[i % len(fns)]()
    for _ in range(max(1, warmup // CALLS_PER_GRAPH)):
        graph.replay()
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(rep):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / CALLS_PER_GRAPH)
    return samples


def _time_cpu(fns: Sequence[Callable], warmup: int, rep: int, max_seconds: float) -> list[float]:
    for i in range(warmup):
        fns[i % len(fns)]()
    samples = []
    deadline = time.perf_counter() + max_seconds
    for i in range(rep):
        t0 = time.perf_counter()
        fns[i % len(fns)]()
        samples.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() > deadline and len(samples) >= 3:
            break
    return samples


def benchmark(
    fn: Callable | Sequence[Callable],
    *,
    device: torch.device | str | None = None,
    warmup: int = 25,
    rep: int = 100,
    flush_l2: bool = True,
    cuda_graph: bool | None = None,
    name: str | None = None,
    cpu_max_seconds: float = 2.0,
) -> Timing:
    """Time `fn()` and return quantiles in milliseconds.

    `fn` may be a list of closures over distinct copies of the inputs: calls rotate through them, so a
    working set that fits in L2 is not served from it. `cuda_graph=None` means "auto": time with events,
    and if the median is under GRAPH_THRESHOLD_MS, re-time under a CUDA graph.
    """
    fns = list(fn) if isinstance(fn, (list, tuple)) else [fn]
    device = torch.device(device) if device is not None else None
    on_gpu = device is not None and device.type == "cuda" and torch.cuda.is_available()
    with nvtx_range(name):
        if not on_gpu:
            samples = _time_cpu(fns, min(warmup, 3), rep, cpu_max_seconds)
            return summarize(samples, {"timer": "time.perf_counter (CPU wall clock)", "device": "cpu",
                                       "warmup": min(warmup, 3), "inputs_rotated": len(fns)})
        if cuda_graph:
            samples = _time_graph(fns, warmup, rep, device)
            return summarize(samples, {"timer": "cuda events around CUDA graph replay", "calls_per_graph":
                                       CALLS_PER_GRAPH, "warmup": warmup, "l2_flush": False,
                                       "inputs_rotated": len(fns)})
        samples = _time_events(fns, warmup, rep, flush_l2, device)
        timing = summarize(samples, {"timer": "cuda events per call", "warmup": warmup, "l2_flush": flush_l2,
                                     "inputs_rotated": len(fns)})
        if cuda_graph is None and timing.median_ms < GRAPH_THRESHOLD_MS:
            return benchmark(fns, device=device, warmup=warmup, rep=rep, cuda_graph=True, name=None)
        return timing


def inputs_for_rotation(bytes_per_set: int, l2_bytes: int | None = None, max_sets: int = 16) -> int:
    """How many input copies to rotate so that consecutive calls never find their inputs in L2."""
    if l2_bytes is None:
        l2_bytes = 64 << 20
        if torch.cuda.is_available():
            l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", l2_bytes) or l2_bytes
    if bytes_per_set <= 0:
        return 1
    return int(max(1, min(max_sets, -(-2 * l2_bytes // bytes_per_set))))


def benchmark_cli(description: str, argv: Sequence[str] | None = None,
                  add_arguments: Callable | None = None) -> tuple[argparse.Namespace, torch.device]:
    """The command line every project benchmark shares: `--quick` (the subset tools/gpu_suite.sh runs),
    `--out DIR` (write JSON result records there), plus whatever `add_arguments(parser)` adds. Returns the
    parsed arguments and the device to time on (the GPU when there is one)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the subset tools/gpu_suite.sh runs")
    parser.add_argument("--out", help="directory to write JSON result records into (e.g. results)")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    return args, torch.device("cuda" if torch.cuda.is_available() else "cpu")


def benchmark_main(description: str, run: Callable, argv: Sequence[str] | None = None,
                   add_arguments: Callable | None = None, run_options: Callable | None = None,
                   no_grad: bool = False) -> int:
    """A project benchmark's entry point: parse `benchmark_cli`'s flags, then call
    `run(device, quick, out, **run_options(args, device))`, under torch.no_grad() when asked."""
    args, device = benchmark_cli(description, argv, add_arguments)
    options = run_options(args, device) if run_options is not None else {}
    with torch.no_grad() if no_grad else contextlib.nullcontext():
        run(device, args.quick, args.out, **options)
    return 0
