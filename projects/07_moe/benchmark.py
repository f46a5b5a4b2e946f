"""Project 07 benchmark: the Triton MoE layer vs a per-expert PyTorch loop and a dense padded bmm.

    python projects/07_moe/benchmark.py [--quick] [--out results]

Two regimes, two metrics:
- decode (tokens <= 16): the layer streams the weights of the experts the tokens chose, so the metric
  is expert-weight bandwidth: bytes = kernel_lab.ops.moe.bytes_moved (used_experts * 3 * H * I * b, plus
  x and the output), as GB/s and % of the measured copy bandwidth;
- prefill (tokens > 16): FLOPs = 6 * tokens * top_k * H * I, as TFLOP/s and % of the measured bf16
  cuBLAS ceiling.
Baselines measured in the same run: a per-expert loop in PyTorch (gather, two F.linear, index_add, in
the activation dtype: what a straightforward implementation does), a dense bmm over all E experts with
every segment padded to the largest one, and this layer with SwiGLU applied by project 02's kernel
between the GEMMs instead of in the first GEMM's epilogue. The new designs run beside the default as their
own rows of the same table: "routing=kernel" (routing and alignment in one kernel) and "raster=grouped"
(grouped tile order in both expert GEMMs).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernel_lab.harness.bench import benchmark, benchmark_main, inputs_for_rotation  # noqa: E402
from kernel_lab.harness.results import ResultRecord  # noqa: E402
from kernel_lab.harness.testing import assert_close  # noqa: E402
from kernel_lab.ops import moe  # noqa: E402
from kernel_lab.ops.common import use_triton  # noqa: E402
from kernel_lab.ops.moe import CONFIGS, _launch, bytes_moved, choose_config, route  # noqa: E402

PROJECT = "07_moe"
SHAPES = {  # name: (E, H, I, top_k)
    "mixtral": (8, 4096, 14336, 2),
    "small": (64, 2048, 768, 2),
}
DECODE_MAX_TOKENS = 16
DESIGNS = (("", {}), (" routing=kernel", {"routing": "kernel"}), (" raster=grouped", {"raster": "grouped"}))


def per_expert_loop(x, w_gate_up, w_down, logits, top_k):
    weights, ids = route(logits, top_k, True)
    I = w_down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w_gate_up.shape[0]):
        token, slot = torch.nonzero(ids == e, as_tuple=True)  # host sync per expert
        if token.numel() == 0:
            continue
        h = F.linear(x[token], w_gate_up[e])
        y = F.linear(F.silu(h[:, :I]) * h[:, I:], w_down[e])
        out.index_add_(0, token, y.float() * weights[token, slot, None])
    return out.to(x.dtype)


def dense_padded_bmm(x, w_gate_up, w_down, logits, top_k):
    """Every expert's segment padded to the largest segment, one bmm over all E experts."""
    weights, ids = route(logits, top_k, True)
    E, I = w_gate_up.shape[0], w_down.shape[2]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    capacity = int(counts.max())  # host sync: the padded size
    expert = flat[order]
    pos = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[expert]
    token_index = torch.zeros((E, capacity), dtype=torch.long, device=x.device)
    slot_weight = torch.zeros((E, capacity), dtype=torch.float32, device=x.device)
    token_index[expert, pos] = order // top_k
    slot_weight[expert, pos] = weights.reshape(-1)[order]
    h = torch.bmm(x[token_index], w_gate_up.transpose(1, 2))
    y = torch.bmm(F.silu(h[..., :I]) * h[..., I:], w_down.transpose(1, 2))
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, token_index.reshape(-1), (y.float() * slot_weight[..., None]).reshape(-1, x.shape[1]))
    return out.to(x.dtype)


def sweep(device: torch.device, quick: bool):
    if device.type != "cuda":
        return {"tiny": (8, 64, 32, 2)}, [1, 32]
    tokens = [1, 16, 2048] if quick else [1, 2, 4, 8, 16, 64, 256, 1024, 4096, 8192]
    return SHAPES, tokens


def tile_sweep(args, top_k, timed) -> str:
    """Time every tile config on one case (printed only, for retuning choose_config on a new GPU)."""
    x, w_gate_up, w_down, _ = args
    chosen = choose_config(x.shape[0] * top_k, w_gate_up.shape[0])
    cells = []
    for _, config in CONFIGS:
        def call(lg, config=config):
            return _launch(x, w_gate_up, w_down, lg, top_k, True, True, config)

        t = timed(call, "tile")
        cells.append(f"m{config.block_m}{'*' if config == chosen else ''}={t.median_ms * 1e3:.1f}us")
    return "  ".join(cells)


def run(device: torch.device, quick: bool, out: str | None, dtype=torch.bfloat16,
        tiles: bool = False) -> list[ResultRecord]:
    shapes, token_counts = sweep(device, quick)
    b = torch.finfo(dtype).bits // 8
    decode = ResultRecord(PROJECT, "moe decode expert-weight bandwidth", device,
                          "tokens <= 16, bf16, top-2; GB/s = weights of the experts actually used "
                          "(3 * H * I * b each) + activations, over the median time; kernel_lab.moe (fused and "
                          "unfused) replayed from CUDA graphs, router logits rotated so weights are not served "
                          "from L2; the loop and dense baselines synchronise with the host and run eagerly")
    prefill = ResultRecord(PROJECT, "moe prefill throughput", device,
                           "tokens > 16, bf16, top-2; TFLOP/s = 6 * tokens * top_k * H * I over the median time")
    checked = passed = 0
    g = torch.Generator(device=device)
    g.manual_seed(0)
    for shape_name, (E, H, I, top_k) in shapes.items():
        w_gate_up = torch.randn((E, 2 * I, H), device=device, dtype=dtype, generator=g) * H ** -0.5
        w_down = torch.randn((E, H, I), device=device, dtype=dtype, generator=g) * I ** -0.5
        for tokens in token_counts:
            is_decode = tokens <= DECODE_MAX_TOKENS
            x = torch.randn((tokens, H), device=device, dtype=dtype, generator=g)
            # Decode touches only a few experts' weights, which can fit in L2 (small shape: 19 MB), and it
            # is replayed from a CUDA graph without L2 flushes: calls rotate over router logits that pick
            # different experts, so consecutive calls do not find their weights in L2.
            per_call = 2 * top_k * 3 * H * I * b
            variants = inputs_for_rotation(per_call) if is_decode and device.type == "cuda" else 1
            logits_sets = [torch.randn((tokens, E), device=device, dtype=torch.float32, generator=g)
                           for _ in range(variants)]
            reps = {"warmup": 5, "rep": 20} if tokens >= 1024 else {}
            graph = True if is_decode and device.type == "cuda" else None

            def timed(fn, tag, tokens=tokens, reps=reps, shape_name=shape_name, logits_sets=logits_sets, **kw):
                fns = [lambda lg=lg: fn(lg) for lg in logits_sets]
                label = f"{tag} {shape_name} tokens={tokens}"
                try:
                    return benchmark(fns, device=device, name=label, **reps, **kw)
                except RuntimeError as exc:  # a capture failure must not cost the whole record
                    if not kw.get("cuda_graph"):
                        raise
                    print(f"WARNING: CUDA-graph timing of {label} failed ({exc}); timed eagerly instead")
                    torch.cuda.synchronize()
                    return benchmark(fns, device=device, name=label, cuda_graph=False, **reps)

            args = (x, w_gate_up, w_down, logits_sets[0])
            expected = per_expert_loop(*args, top_k)
            for tag, design in DESIGNS:
                checked += 1
                try:
                    assert_close(moe(*args, top_k=top_k, **design), expected, dtype, scale=4.0)
                    passed += 1
                except AssertionError as exc:
                    print(f"MISMATCH {shape_name} tokens={tokens}{tag}: {exc}")
            baselines = {
                "per-expert loop": timed(lambda lg: per_expert_loop(x, w_gate_up, w_down, lg, top_k), "loop"),
                "dense padded bmm": timed(lambda lg: dense_padded_bmm(x, w_gate_up, w_down, lg, top_k), "dense"),
                "unfused swiglu": timed(lambda lg: moe(x, w_gate_up, w_down, lg, top_k=top_k, fuse_swiglu=False),
                                        "unfused", cuda_graph=graph),
            }
            if graph:  # what the same calls cost when every launch goes through the host
                baselines["kernel_lab.moe eager"] = timed(lambda lg: moe(x, w_gate_up, w_down, lg, top_k=top_k),
                                                          "eager", cuda_graph=False)
            if tiles and use_triton(x):
                print(f"tiles {shape_name} tokens={tokens}: {tile_sweep(args, top_k, timed)}  (* = chosen)")
            used = [int(torch.unique(route(lg, top_k, True)[1]).numel()) for lg in logits_sets]
            shape = {"E": E, "H": H, "I": I, "top_k": top_k, "tokens": tokens,
                     "used_experts": sum(used) / len(used), "router_variants": variants}
            # decode's routing win is in launches: also time the one-kernel routing eagerly, against the
            # "kernel_lab.moe eager" column
            runs = [(tag, design, graph) for tag, design in DESIGNS]
            if graph:
                runs.append((" routing=kernel eager", {"routing": "kernel"}, False))
            for tag, design, as_graph in runs:
                t = timed(lambda lg, d=design: moe(x, w_gate_up, w_down, lg, top_k=top_k, **d), f"kernel_lab.moe{tag}",
                          cuda_graph=as_graph)
                name = f"{shape_name} tokens={tokens}{tag}"
                extra = {"routing": design.get("routing", "torch"), "raster": design.get("raster", "m_fastest")}
                if is_decode:
                    decode.add_case(name, shape=shape, dtype="bf16", timing=t, baselines=baselines, extra=extra,
                                    nbytes=bytes_moved(tokens, H, I, sum(used) / len(used), b))
                else:
                    prefill.add_case(name, shape=shape, dtype="bf16", timing=t, baselines=baselines, extra=extra,
                                     flops=6.0 * tokens * top_k * H * I)
    records = []
    for rec, what in ((decode, "expert-weight bandwidth"), (prefill, "throughput")):
        if not rec.record["cases"]:
            continue
        rec.set_correctness(passed, checked)
        cases = [c for c in rec.record["cases"] if c["routing"] == "torch" and c["raster"] == "m_fastest"]
        worst = min(cases, key=lambda c: c["percent_of_ceiling"])
        rec.set_headline(f"moe {what}: worst case {worst['name']} at {worst['percent_of_ceiling']:.1f}% of the "
                         f"measured {worst['ceiling']} ceiling",
                         percent_of_ceiling=worst["percent_of_ceiling"],
                         speedup=min(c["speedup"]["per-expert loop"] for c in cases), baseline="per-expert loop")
        rec.emit(out)
        records.append(rec)
    print(f"correctness vs the per-expert loop: {passed}/{checked}")
    return records


def _add_arguments(parser) -> None:
    parser.add_argument("--tiles", action="store_true", help="also time every tile config (printed, not recorded)")


if __name__ == "__main__":
    raise SystemExit(benchmark_main(__doc__, run, add_arguments=_add_arguments,
                                    run_options=lambda args, device: {"tiles": args.tiles}, no_grad=True))
