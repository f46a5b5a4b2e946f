"""Project 02 benchmark: silu_and_mul vs torch eager, torch.compile and (if installed) Liger; gelu_and_mul
(tanh, Gemma's form) vs torch eager and torch.compile.

    python projects/02_swiglu/benchmark.py [--quick] [--out results]

Bytes moved per call: read [tokens, 2*d], write [tokens, d] -> 3 * tokens * d * b. GB/s is reported
against the copy bandwidth measured on the same device (the copy reads and writes too, so a kernel
that only streams memory can approach 100%).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernel_lab.harness.bench import benchmark, benchmark_main, inputs_for_rotation  # noqa: E402
from kernel_lab.harness.results import ResultRecord  # noqa: E402
from kernel_lab.ops import gelu_and_mul, silu_and_mul  # noqa: E402
from kernel_lab.ops.swiglu import bytes_moved  # noqa: E402

PROJECT = "02_swiglu"
# Intermediate sizes of real models: Qwen2.5-1.5B (8960), Llama-2-7B (11008), Llama-3-8B / Mistral-7B
# (14336), Qwen2.5-7B (18944), and a small-MoE expert width (1536).
MODEL_D = [1536, 8960, 11008, 14336, 18944]
LARGE_ELEMENTS = 32 * 2**20  # tokens * d from which the bandwidth target applies


def eager_swiglu(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def eager_geglu(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def _compiled(fn=eager_swiglu):
    import torch._dynamo.config as dynamo_config

    # One specialised graph per shape, as a serving engine would capture; the default limit of 8 would
    # silently fall back to eager partway through the sweep.
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(dynamo_config, knob):
            setattr(dynamo_config, knob, 256)
    return torch.compile(fn, dynamic=False)


def _liger():
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception:  # noqa: BLE001 - optional baseline
        return None

    def run(x):
        d = x.shape[-1] // 2
        return LigerSiLUMulFunction.apply(x[..., :d], x[..., d:])  # Liger copies strided halves first

    return run


def sweep(device: torch.device, quick: bool) -> list[tuple[int, int]]:
    if device.type != "cuda":
        return [(1, 256), (4, 1000)]
    if quick:
        return [(t, d) for d in (8960, 14336) for t in (1, 16, 4096, 32768)]
    return [(t, d) for d in MODEL_D for t in (1, 16, 128, 1024, 4096, 16384, 32768)]


def run(device: torch.device, quick: bool, out: str | None, dtype=torch.bfloat16) -> ResultRecord:
    on_gpu = device.type == "cuda"
    compiled = _compiled() if on_gpu else None
    compiled_geglu = _compiled(eager_geglu) if on_gpu else None
    liger = _liger() if on_gpu else None
    rec = ResultRecord(PROJECT, "swiglu bandwidth", device,
                       "silu_and_mul and gelu_and_mul(approximate='tanh') on x = [gate | up], bf16; "
                       "GB/s = swiglu.bytes_moved (bytes read + written, 3 * tokens * d * b); small calls are "
                       "timed as CUDA-graph replays by the harness")
    with torch.no_grad():
        for tokens, d in sweep(device, quick):
            nbytes = bytes_moved(tokens, d, dtype.itemsize)
            sets = inputs_for_rotation(nbytes)
            xs = [torch.randn(tokens, 2 * d, device=device, dtype=dtype) for _ in range(sets)]
            outs = [torch.empty(tokens, d, device=device, dtype=dtype) for _ in xs]
            label = f"tokens={tokens} d={d}"

            def timed(f, tag, xs=xs, label=label):
                return benchmark([lambda x=x: f(x) for x in xs], device=device, name=f"{tag} {label}")

            ours = [lambda x=x, o=o: silu_and_mul(x, out=o) for x, o in zip(xs, outs, strict=True)]
            t_ours = benchmark(ours, device=device, name=f"kernel_lab.silu_and_mul {label}")
            baselines = {"torch eager": timed(eager_swiglu, "eager")}
            if compiled is not None:
                baselines["torch.compile"] = timed(compiled, "compile")
            if liger is not None:
                baselines["liger"] = timed(liger, "liger")
            rec.add_case(f"silu_and_mul {label}", shape={"tokens": tokens, "d": d}, dtype="bf16",
                         timing=t_ours, nbytes=nbytes, baselines=baselines)
            # GeGLU: the same kernel and traffic with a costlier activation (a cube and the exp)
            geglu = [lambda x=x, o=o: gelu_and_mul(x, out=o, approximate="tanh") for x, o in zip(xs, outs, strict=True)]
            t_geglu = benchmark(geglu, device=device, name=f"kernel_lab.gelu_and_mul tanh {label}")
            geglu_baselines = {"torch eager": timed(eager_geglu, "eager geglu")}
            if compiled_geglu is not None:
                geglu_baselines["torch.compile"] = timed(compiled_geglu, "compile geglu")
            rec.add_case(f"gelu_and_mul tanh {label}", shape={"tokens": tokens, "d": d}, dtype="bf16",
                         timing=t_geglu, nbytes=nbytes, baselines=geglu_baselines)
            del xs, outs, timed
    large = [c for c in rec.record["cases"] if c["shape"]["tokens"] * c["shape"]["d"] >= LARGE_ELEMENTS
             and c["name"].startswith("silu")]
    if large:
        worst = min(large, key=lambda c: c["percent_of_ceiling"])
        rec.set_headline(
            f"silu_and_mul bf16, tokens*d >= 32M: worst case {worst['percent_of_ceiling']:.1f}% of measured "
            f"copy bandwidth ({worst['name']})", percent_of_ceiling=worst["percent_of_ceiling"],
            speedup=min(c["speedup"].get("torch.compile", 0.0) for c in large), baseline="torch.compile")
    rec.emit(out)
    return rec


if __name__ == "__main__":
    raise SystemExit(benchmark_main(__doc__, run))
