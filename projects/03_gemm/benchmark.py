"""Project 03 benchmark: matmul (Triton, and CuTe DSL when installed) vs cuBLAS (torch.matmul).

    python projects/03_gemm/benchmark.py [--quick] [--out results] [--dtype bf16|fp16]

Cases: square M = N = K from 512 to 8192, and the QKV, O, gate-up and down projections of Qwen2.5-1.5B and
Llama-3-8B at M = 1, 16, 128 and 4096 tokens, with nn.Linear weights ([N, K], so B = W^T is read in place).
FLOPs per call: 2*M*N*K. Each row reports TFLOP/s, % of the measured cuBLAS bf16 ceiling, and the ratio
to cuBLAS on the same shape in the same run (x cuBLAS = cuBLAS time / our time; 1.00 = parity). Decode-sized
cases (M <= 32) are weight streams: they report GB/s and % of the measured copy bandwidth instead, with bytes
from kernel_lab.ops.gemm.bytes_moved, and run the split-K kernel ("triton splitk") beside the default.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernel_lab.harness.bench import benchmark, benchmark_main, inputs_for_rotation  # noqa: E402
from kernel_lab.harness.results import ResultRecord  # noqa: E402
from kernel_lab.harness.testing import assert_close  # noqa: E402
from kernel_lab.ops import gemm, matmul  # noqa: E402

PROJECT = "03_gemm"
CUBLAS = "cuBLAS (torch.matmul)"
DECODE_MAX_M = 32  # up to here the split-K kernel runs beside the default and the metric is bandwidth


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int

    def projections(self) -> dict[str, tuple[int, int]]:
        """name -> (N, K) of each linear layer's weight [N, K]."""
        q = self.q_heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return {
            "qkv": (q + 2 * kv, self.hidden),
            "o": (self.hidden, q),
            "gate_up": (2 * self.intermediate, self.hidden),
            "down": (self.hidden, self.intermediate),
        }


MODELS = [Model("qwen2.5-1.5b", 1536, 8960, 12, 2, 128), Model("llama3-8b", 4096, 14336, 32, 8, 128)]
TOKENS = (1, 16, 128, 4096)
SQUARE = (512, 1024, 2048, 4096, 8192)


def cases(device: torch.device, quick: bool) -> list[tuple[str, int, int, int]]:
    """(label, M, N, K)."""
    if device.type != "cuda":  # functional CPU run: reference path, tiny shapes
        return [("square 64", 64, 64, 64), ("tiny qkv M=1", 1, 96, 48), ("odd 33x40x57", 33, 40, 57)]
    out = []
    squares = (4096, 8192) if quick else SQUARE
    out += [(f"square {n}", n, n, n) for n in squares]
    if quick:  # one decode, one small-batch and two prefill shapes, both models
        picks = [("llama3-8b", "qkv", 1), ("llama3-8b", "gate_up", 4096), ("qwen2.5-1.5b", "down", 16),
                 ("qwen2.5-1.5b", "qkv", 128)]
    else:
        picks = [(m.name, p, t) for m in MODELS for p in m.projections() for t in TOKENS]
    by_name = {m.name: m for m in MODELS}
    for model, proj, tokens in picks:
        n, k = by_name[model].projections()[proj]
        out.append((f"{model} {proj} M={tokens}", tokens, n, k))
    return out


def cute_status(device: torch.device) -> str | None:
    """None when the CuTe backend can run here, else the reason it is skipped."""
    if device.type != "cuda":
        return "CPU run: the CuTe DSL has no CPU execution (backend='cute' falls back to the reference)"
    if importlib.util.find_spec("cutlass") is None:
        return "nvidia-cutlass-dsl is not installed (`import cutlass` fails): CuTe backend not measured"
    return None


def run(device: torch.device, quick: bool, out: str | None, dtype: torch.dtype = torch.bfloat16,
        variants: bool = False) -> ResultRecord:
    dname = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    skip_cute = cute_status(device)
    if skip_cute:
        print(f"[03_gemm] skipping backend='cute': {skip_cute}")
    rec = ResultRecord(PROJECT, f"gemm {dname}" + (" quick" if quick else ""), device,
                       f"C = A @ W^T, A [M, K], W [N, K] (nn.Linear layout), {dname} in/out, fp32 accumulate; "
                       "TFLOP/s = 2*M*N*K / median time; baseline cuBLAS via torch.matmul in the same run")
    checked = passed = 0
    with torch.no_grad():
        for label, M, N, K in cases(device, quick):
            sets = inputs_for_rotation(gemm.bytes_moved(M, N, K, dtype.itemsize)) if device.type == "cuda" else 1
            xs = [torch.randn(M, K, device=device, dtype=dtype) for _ in range(sets)]
            ws = [torch.randn(N, K, device=device, dtype=dtype) / K**0.5 for _ in range(sets)]
            outs = [torch.empty(M, N, device=device, dtype=dtype) for _ in range(sets)]
            flops = 2.0 * M * N * K
            shape = {"M": M, "N": N, "K": K}
            t_cublas = benchmark([lambda x=x, w=w, o=o: torch.matmul(x, w.t(), out=o)
                                  for x, w, o in zip(xs, ws, outs, strict=True)], device=device,
                                 name=f"cublas {label}")
            runs = [("triton", "triton", "auto")]
            decode = M <= DECODE_MAX_M
            if decode:
                runs.append(("triton splitk", "triton", "splitk"))
            if variants and device.type == "cuda" and label.startswith("square"):
                runs += [("triton persistent", "triton", "persistent"), ("triton tiled", "triton", "tiled")]
            if not skip_cute:
                runs.append(("cute", "cute", "auto"))
            for tag, backend, variant in runs:
                def call(x, w, o, backend=backend, variant=variant):
                    return matmul(x, w.t(), out=o, backend=backend, variant=variant)

                reference = torch.matmul(xs[0].float(), ws[0].float().t())
                call(xs[0], ws[0], outs[0])  # compiles / autotunes outside the timed region
                checked += 1
                try:
                    assert_close(outs[0], reference, dtype, scale=1.0 + K / 4096)
                    passed += 1
                except AssertionError as exc:
                    print(f"[03_gemm] WRONG RESULT {tag} {label}: {exc}")
                t = benchmark([lambda x=x, w=w, o=o, call=call: call(x, w, o)
                               for x, w, o in zip(xs, ws, outs, strict=True)], device=device, name=f"{tag} {label}")
                splits = gemm.splitk_shape(M, N, K, device)[0] if variant == "splitk" else 1
                traffic = {"nbytes": gemm.bytes_moved(M, N, K, dtype.itemsize, splits)} if decode else {"flops": flops}
                rec.add_case(f"{tag} {label}", shape=shape, dtype=dname, timing=t, **traffic,
                             baselines={CUBLAS: t_cublas},
                             extra={"backend": backend, "variant": variant, "splits": splits, "flops": flops,
                                    "percent_of_cublas": 100.0 * t_cublas.median_ms / t.median_ms})
            del xs, ws, outs
    rec.set_correctness(passed, checked)
    _headline(rec, dname)
    print(rec.table())
    print("x cuBLAS = cuBLAS time / kernel time (1.00 = parity); % ceil = share of the measured cuBLAS "
          f"8192^3 bf16 TFLOP/s, or for M <= {DECODE_MAX_M} (GB/s rows) of the measured copy bandwidth")
    path = rec.write(out)
    if path:
        print(f"wrote {path}")
    return rec


def _headline(rec: ResultRecord, dname: str) -> None:
    cases_ = rec.record["cases"]
    parts, values = [], {}
    for backend, variant in (("triton", "auto"), ("cute", "auto"), ("triton", "splitk")):
        mine = [c for c in cases_ if c["backend"] == backend and c["variant"] == variant]
        label = backend if variant == "auto" else f"{backend} {variant}"
        key = label.replace(" ", "_")
        if not mine:
            continue
        for n in (4096, 8192):
            hit = [c for c in mine if c["name"] == f"{label} square {n}"]
            if hit:
                pct = hit[0]["percent_of_cublas"]
                parts.append(f"{label} {n}^3 {pct:.0f}% of cuBLAS")
                values[f"{key}_{n}_percent_of_cublas"] = pct
        worst = min(mine, key=lambda c: c["percent_of_cublas"])
        parts.append(f"{label} worst {worst['percent_of_cublas']:.0f}% ({worst['name']})")
        values[f"{key}_worst_percent_of_cublas"] = worst["percent_of_cublas"]
    if parts:
        rec.set_headline(f"gemm {dname}: " + "; ".join(parts), baseline=CUBLAS, **values)


def _add_arguments(parser) -> None:
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--variants", action="store_true",
                        help="also time the persistent and tiled Triton kernels on the square sizes")


def _run_options(args, device) -> dict:
    return {"dtype": torch.bfloat16 if args.dtype == "bf16" else torch.float16, "variants": args.variants}


if __name__ == "__main__":
    raise SystemExit(benchmark_main(__doc__, run, add_arguments=_add_arguments, run_options=_run_options))
