"""Project 01 benchmark: RMSNorm and fused add + RMSNorm vs torch eager, torch.compile and Liger.

    python projects/01_rmsnorm/benchmark.py [--quick] [--out results]

Bytes moved per call: rms_norm reads x and writes y (2 * rows * H * b, plus H weight bytes);
fused_add_rms_norm reads x and residual and writes normed and the new residual (4 * rows * H * b).
GB/s is reported against the copy bandwidth measured on the same device.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernel_lab.harness.bench import benchmark, benchmark_main, inputs_for_rotation  # noqa: E402
from kernel_lab.harness.results import ResultRecord  # noqa: E402
from kernel_lab.ops import fused_add_rms_norm, rms_norm  # noqa: E402
from kernel_lab.ops.rmsnorm import fused_add_rms_norm_reference, rms_norm_reference  # noqa: E402

PROJECT = "01_rmsnorm"


def _liger():
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps)
    except Exception:  # noqa: BLE001 - optional baseline
        return None


def sweep(device: torch.device, quick: bool):
    if device.type != "cuda":
        return [(4, 1024)], [1, 4]
    hidden = [4096, 8192] if quick else [1024, 2048, 4096, 5120, 8192, 16384]
    rows = [1024, 8192, 32768] if quick else [1, 16, 256, 1024, 4096, 8192, 16384, 32768]
    return [(r, h) for h in hidden for r in rows], ([1, 4, 16] if quick else [1, 2, 4, 8, 16])


def run(device: torch.device, quick: bool, out: str | None, dtype=torch.bfloat16) -> list[ResultRecord]:
    shapes, small_rows = sweep(device, quick)
    eps = 1e-6
    compiled = torch.compile(rms_norm_reference) if device.type == "cuda" else None
    compiled_fused = torch.compile(fused_add_rms_norm_reference) if device.type == "cuda" else None
    liger = _liger() if device.type == "cuda" else None
    bw = ResultRecord(PROJECT, "rmsnorm bandwidth", device,
                      "rms_norm and fused_add_rms_norm, bf16, one row per program; GB/s = bytes read + written")
    for rows, H in shapes:
        b = torch.finfo(dtype).bits // 8
        w = torch.randn(H, device=device, dtype=dtype)
        n_sets = inputs_for_rotation(2 * rows * H * b)
        xs = [torch.randn(rows, H, device=device, dtype=dtype) for _ in range(n_sets)]
        rs = [torch.randn(rows, H, device=device, dtype=dtype) for _ in range(n_sets)]
        nbytes = 2 * rows * H * b + H * b

        def timed(f, tag):
            return benchmark([lambda x=x: f(x) for x in xs], device=device, name=f"{tag} rows={rows} H={H}")

        t_ours = timed(lambda x: rms_norm(x, w, eps), "kernel_lab.rms_norm")
        baselines = {"torch eager": timed(lambda x: rms_norm_reference(x, w, eps), "eager")}
        if compiled is not None:
            baselines["torch.compile"] = timed(lambda x: compiled(x, w, eps), "compile")
        if liger is not None:
            baselines["liger"] = timed(lambda x: liger(x, w, eps), "liger")
        bw.add_case(f"rms_norm rows={rows} H={H}", shape={"rows": rows, "H": H}, dtype="bf16", timing=t_ours,
                    nbytes=nbytes, baselines=baselines)

        pairs = list(zip(xs, rs))
        t_fused = benchmark([lambda p=p: fused_add_rms_norm(p[0], p[1], w, eps) for p in pairs], device=device,
                            name=f"fused rows={rows} H={H}")
        fb = {"torch eager": benchmark([lambda p=p: fused_add_rms_norm_reference(p[0], p[1], w, eps) for p in pairs],
                                       device=device)}
        if compiled_fused is not None:
            fb["torch.compile"] = benchmark([lambda p=p: compiled_fused(p[0], p[1], w, eps) for p in pairs],
                                            device=device)
        bw.add_case(f"fused_add_rms_norm rows={rows} H={H}", shape={"rows": rows, "H": H}, dtype="bf16",
                    timing=t_fused, nbytes=2 * nbytes - 2 * H * b + H * b, baselines=fb)
    cases = [c for c in bw.record["cases"] if c["name"].startswith("rms_norm") and c["shape"]["rows"] >= 8192
             and c["shape"]["H"] in (4096, 8192)]
    if cases:
        worst = min(cases, key=lambda c: c["percent_of_ceiling"])
        bw.set_headline(f"rms_norm bf16, >=8K rows, H=4096/8192: worst case {worst['percent_of_ceiling']:.1f}% of "
                        "measured copy bandwidth", percent_of_ceiling=worst["percent_of_ceiling"],
                        speedup=min(c["speedup"].get("torch.compile", 0) for c in cases), baseline="torch.compile")

    lat = ResultRecord(PROJECT, "rmsnorm small-batch latency", device,
                       "1-16 rows, timed as CUDA-graph replays (launch overhead amortised)")
    for rows in small_rows:
        H = 4096 if device.type == "cuda" else 1024
        x = torch.randn(rows, H, device=device, dtype=dtype)
        w = torch.randn(H, device=device, dtype=dtype)
        out_buf = torch.empty_like(x)
        graph = device.type == "cuda"
        t = benchmark(lambda: rms_norm(x, w, eps, out=out_buf), device=device, cuda_graph=graph)
        base = {"torch eager": benchmark(lambda: rms_norm_reference(x, w, eps), device=device, cuda_graph=graph)}
        if compiled is not None:
            base["torch.compile"] = benchmark(lambda: compiled(x, w, eps), device=device, cuda_graph=graph)
        lat.add_case(f"rms_norm rows={rows} H={H}", shape={"rows": rows, "H": H}, dtype="bf16", timing=t,
                     nbytes=2 * rows * H * 2 + H * 2, baselines=base)

    for rec in (bw, lat):
        rec.emit(out)
    return [bw, lat]


if __name__ == "__main__":
    raise SystemExit(benchmark_main(__doc__, run))
