"""Project 01 benchmark: RMSNorm and fused add + RMSNorm vs torch eager, torch.compile and Liger.

    python projects/01_rmsnorm/benchmark.py [--quick] [--out results]

Both kernel designs run in the same table: the one-row-per-program kernel ("kernel_lab", the default) and
the multirow kernel ("kernel_lab multirow"). Bytes per call come from kernel_lab.ops.rmsnorm.bytes_moved (x
read, y written, the fused op's residual read and written, the weight row once); GB/s is reported against
the copy bandwidth measured on the same device.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernel_lab.harness.bench import benchmark, benchmark_main, inputs_for_rotation  # noqa: E402
from kernel_lab.harness.results import ResultRecord  # noqa: E402
from kernel_lab.ops import fused_add_rms_norm, rms_norm  # noqa: E402
from kernel_lab.ops.rmsnorm import bytes_moved, fused_add_rms_norm_reference, rms_norm_reference  # noqa: E402

PROJECT = "01_rmsnorm"
VARIANT_TAGS = (("auto", ""), ("multirow", " multirow"))  # (variant=, case-name tag); "" keeps the old names


def _liger():
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps)
    except Exception:  # noqa: BLE001 - optional baseline
        return None


def sweep(device: torch.device, quick: bool):
    if device.type != "cuda":
        return [(4, 1024)], [1, 4]
    hidden = [4096, 8192] if quick else [1024, 2048, 4096, 5120, 8192, 16384, 32768]
    rows = [1024, 8192, 32768] if quick else [1, 16, 256, 1024, 4096, 8192, 16384, 32768]
    return [(r, h) for h in hidden for r in rows], ([1, 4, 16] if quick else [1, 2, 4, 8, 16])


def run(device: torch.device, quick: bool, out: str | None, dtype=torch.bfloat16) -> list[ResultRecord]:
    shapes, small_rows = sweep(device, quick)
    eps = 1e-6
    compiled = torch.compile(rms_norm_reference) if device.type == "cuda" else None
    compiled_fused = torch.compile(fused_add_rms_norm_reference) if device.type == "cuda" else None
    liger = _liger() if device.type == "cuda" else None
    dname = str(dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float16", "fp16")
    bw = ResultRecord(PROJECT, "rmsnorm bandwidth", device,
                      f"rms_norm and fused_add_rms_norm, {dname}: the one-row kernel and the multirow kernel; "
                      "GB/s = rmsnorm.bytes_moved (bytes read + written) over the median time")
    for rows, H in shapes:
        b = dtype.itemsize
        w = torch.randn(H, device=device, dtype=dtype)
        n_sets = inputs_for_rotation(bytes_moved(rows, H, b))
        xs = [torch.randn(rows, H, device=device, dtype=dtype) for _ in range(n_sets)]
        rs = [torch.randn(rows, H, device=device, dtype=dtype) for _ in range(n_sets)]
        pairs = list(zip(xs, rs))
        shape = {"rows": rows, "H": H}

        def timed(f, tag):
            return benchmark([lambda x=x: f(x) for x in xs], device=device, name=f"{tag} rows={rows} H={H}")

        def timed_pairs(f, tag):
            return benchmark([lambda p=p: f(*p) for p in pairs], device=device, name=f"{tag} rows={rows} H={H}")

        baselines = {"torch eager": timed(lambda x: rms_norm_reference(x, w, eps), "eager")}
        if compiled is not None:
            baselines["torch.compile"] = timed(lambda x: compiled(x, w, eps), "compile")
        if liger is not None:
            baselines["liger"] = timed(lambda x: liger(x, w, eps), "liger")
        fused_baselines = {"torch eager": timed_pairs(lambda x, r: fused_add_rms_norm_reference(x, r, w, eps), "eager")}
        if compiled_fused is not None:
            fused_baselines["torch.compile"] = timed_pairs(lambda x, r: compiled_fused(x, r, w, eps), "compile")
        for variant, tag in VARIANT_TAGS:
            t = timed(lambda x, v=variant: rms_norm(x, w, eps, variant=v), f"{tag} rms_norm")
            bw.add_case(f"rms_norm{tag} rows={rows} H={H}", shape=shape, dtype=dname, timing=t,
                        nbytes=bytes_moved(rows, H, b), baselines=baselines, extra={"variant": variant})
            t = timed_pairs(lambda x, r, v=variant: fused_add_rms_norm(x, r, w, eps, variant=v), f"{tag} fused")
            bw.add_case(f"fused_add_rms_norm{tag} rows={rows} H={H}", shape=shape, dtype=dname, timing=t,
                        nbytes=bytes_moved(rows, H, b, residual=True), baselines=fused_baselines,
                        extra={"variant": variant})
    cases = [c for c in bw.record["cases"] if c["name"].startswith("rms_norm rows") and c["shape"]["rows"] >= 8192
             and c["shape"]["H"] in (4096, 8192)]
    if cases:
        worst = min(cases, key=lambda c: c["percent_of_ceiling"])
        multirow = [c for c in bw.record["cases"] if c["name"].startswith("rms_norm multirow")
                    and c["shape"]["rows"] >= 8192 and c["shape"]["H"] in (4096, 8192)]
        worst_multirow = min(multirow, key=lambda c: c["percent_of_ceiling"])
        bw.set_headline(f"rms_norm {dname}, >=8K rows, H=4096/8192: worst case {worst['percent_of_ceiling']:.1f}% "
                        f"of measured copy bandwidth (multirow kernel: {worst_multirow['percent_of_ceiling']:.1f}%)",
                        percent_of_ceiling=worst["percent_of_ceiling"],
                        multirow_percent_of_ceiling=worst_multirow["percent_of_ceiling"],
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
        lat.add_case(f"rms_norm rows={rows} H={H}", shape={"rows": rows, "H": H}, dtype=dname, timing=t,
                     nbytes=bytes_moved(rows, H, dtype.itemsize), baselines=base)

    for rec in (bw, lat):
        rec.emit(out)
    return [bw, lat]


if __name__ == "__main__":
    raise SystemExit(benchmark_main(__doc__, run))
