"""Project 05 benchmark: FP8 E4M3 paged KV cache against the fp16 cache it replaces.

    python projects/05_fp8_kv/benchmark.py [--quick] [--out results]

Reports, per shape: decode speed of the fp8 cache against fp16 paged decode at the same shape (both this
repo's CUDA kernel), GB/s of the fp8 call's bytes (kernel_lab.ops.paged_attention.bytes_moved) against the
copy bandwidth, and the decode error of the fp8 path against the fp16 path on the same data (the fp16 cache
written into an fp8 cache with write_kv: mean and max abs, relative L2). Storage saved counts K and V bytes
plus the float32 page scales. A second record times write_kv into the fp8 cache against the fp16 copy: a
decode step's append (one token per sequence, each on its own page) and a prefill chunk, GB/s from
kernel_lab.ops.kv_cache.write_kv_bytes_moved (steady state: the timed calls rewrite the same rows, so no
page scale grows after the first).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernel_lab.harness.bench import benchmark_main  # noqa: E402
from kernel_lab.harness.results import ResultRecord  # noqa: E402
from kernel_lab.ops import allocate_kv_cache, paged_decode_attention, write_kv  # noqa: E402
from kernel_lab.ops.kv_cache import FP8_DTYPE, kv_cache_bytes, write_kv_bytes_moved  # noqa: E402

PROJECT = "05_fp8_kv"
_spec = importlib.util.spec_from_file_location(
    "paged_decode_benchmark", Path(__file__).resolve().parents[1] / "04_paged_decode" / "benchmark.py")
_paged = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_paged)
HEAD_DIM, BLOCK_SIZE, build_case, benchmark = _paged.HEAD_DIM, _paged.BLOCK_SIZE, _paged.build_case, _paged.benchmark
LAYOUTS = _paged.LAYOUTS


def storage_table() -> list[tuple[int, int, float]]:
    """(block_size, head_dim, % saved against fp16) for every supported geometry."""
    rows = []
    for block_size in (8, 16, 32, 64):
        for head_dim in (64, 96, 128, 256):
            fp16 = kv_cache_bytes(1024, block_size, 8, head_dim, torch.float16)
            fp8 = kv_cache_bytes(1024, block_size, 8, head_dim, FP8_DTYPE)
            rows.append((block_size, head_dim, 100.0 * (1 - fp8 / fp16)))
    return rows


def fp8_copy_of(k16, v16):
    """The fp16 cache's contents written into a fresh fp8 cache through write_kv (the production path)."""
    num_blocks, block_size, heads, head_dim = k16.shape
    k8, v8, k_scale, v_scale = allocate_kv_cache(num_blocks, block_size, heads, head_dim, FP8_DTYPE, k16.device)
    slots = torch.arange(num_blocks * block_size, device=k16.device)
    write_kv(k16.reshape(-1, heads, head_dim), v16.reshape(-1, heads, head_dim), k8, v8, slots, k_scale, v_scale)
    return k8, v8, k_scale, v_scale


def sweep(device: torch.device, quick: bool):
    if device.type != "cuda":
        return [(1, 256), (2, 128)]
    if quick:
        return [(1, 32768), (16, 8192), (64, 2048)]
    return [(b, c) for b in (1, 16, 64, 256) for c in (2048, 8192, 32768)]


def measure(record, layout, batch, context, num_q_heads, num_kv_heads, dtype, device) -> dict:
    q, k16, v16, tables, seq_lens, _, _ = build_case(batch, context, num_q_heads, num_kv_heads, dtype, device)
    k8, v8, k_scale, v_scale = fp8_copy_of(k16, v16)
    out16, out8 = torch.empty_like(q), torch.empty_like(q)

    def fp16_decode():
        return paged_decode_attention(q, k16, v16, tables, seq_lens, out=out16)

    def fp8_decode(variant="direct"):
        return paged_decode_attention(q, k8, v8, tables, seq_lens, k_scale=k_scale, v_scale=v_scale, out=out8,
                                      variant=variant)

    label = f"{layout} batch={batch} ctx={context}"
    t16 = benchmark(fp16_decode, device=device, name=f"fp16 {label}")
    t8 = benchmark(fp8_decode, device=device, name=f"fp8 {label}")
    baselines = {"fp16 paged decode": t16}
    if device.type == "cuda":  # the CPU paths have one implementation: the variants are CUDA's
        baselines["fp8 pipelined variant (16-byte cp.async)"] = benchmark(
            lambda: fp8_decode("pipelined"), device=device, name=f"fp8 pipelined {label}")
    diff = fp8_decode().double() - fp16_decode().double()
    error = {"mean_abs": float(diff.abs().mean()), "max_abs": float(diff.abs().max()),
             "rel_l2": float(diff.norm() / out16.double().norm())}
    fp8_bytes = _paged.call_bytes(batch, context, num_q_heads, num_kv_heads, dtype, FP8_DTYPE)
    print(f"{label}: fp8 vs fp16 decode error mean_abs={error['mean_abs']:.2e} "
          f"max_abs={error['max_abs']:.2e} rel_l2={error['rel_l2']:.2e}")
    return record.add_case(label, shape={"layout": layout, "batch": batch, "context": context,
                                         "num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads},
                           dtype="fp8_e4m3", timing=t8, nbytes=fp8_bytes, baselines=baselines,
                           extra={"error_vs_fp16": error})


def write_record(device: torch.device, quick: bool, dtype: torch.dtype) -> ResultRecord:
    """write_kv of `tokens` rows onto `tokens` distinct pages (decode appends) or a dense prefill chunk,
    into an fp8 cache (the case) and an fp16 one (the baseline), for each layout's KV heads."""
    on_gpu = device.type == "cuda"
    record = ResultRecord(PROJECT, "fp8 write_kv", device,
                          f"write_kv of {str(dtype).replace('torch.', '')} key/value rows into the fp8 cache vs the "
                          f"same-dtype cache, head_dim {HEAD_DIM}, block_size {BLOCK_SIZE}; GB/s = "
                          "kv_cache.write_kv_bytes_moved (rows read and stored, slots, fp8 page scales)")
    shapes = ([("append", 256), ("prefill", 4096)] if quick else [("append", b) for b in (1, 16, 64, 256)]
              + [("prefill", 512), ("prefill", 4096)]) if on_gpu else [("append", 4), ("prefill", 64)]
    g = torch.Generator(device="cpu").manual_seed(2)
    for layout, (_, num_kv_heads) in LAYOUTS.items():
        num_kv_heads = num_kv_heads if on_gpu else num_kv_heads // 4 or 1
        for kind, tokens in shapes:
            per_page = 1 if kind == "append" else BLOCK_SIZE
            pages = -(-tokens // per_page)
            num_blocks = pages + 1
            slots = torch.arange(tokens) if per_page == BLOCK_SIZE else torch.arange(tokens) * BLOCK_SIZE + 3
            slots = slots.to(device)
            key = torch.randn((tokens, num_kv_heads, HEAD_DIM), generator=g).to(device, dtype)
            value = torch.randn((tokens, num_kv_heads, HEAD_DIM), generator=g).to(device, dtype)
            k8, v8, k_scale, v_scale = allocate_kv_cache(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, FP8_DTYPE,
                                                         device)
            k16, v16, _, _ = allocate_kv_cache(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, dtype, device)
            label = f"{layout} {kind} tokens={tokens}"
            t8 = benchmark(lambda: write_kv(key, value, k8, v8, slots, k_scale, v_scale, validate=False),
                           device=device, name=f"fp8 write_kv {label}")
            t16 = benchmark(lambda: write_kv(key, value, k16, v16, slots, validate=False), device=device,
                            name=f"same-dtype write_kv {label}")
            record.add_case(label, shape={"layout": layout, "kind": kind, "tokens": tokens, "pages": pages,
                                          "num_kv_heads": num_kv_heads, "head_dim": HEAD_DIM},
                            dtype="fp8_e4m3", timing=t8, baselines={"same-dtype write_kv": t16},
                            nbytes=write_kv_bytes_moved(tokens, num_kv_heads, HEAD_DIM, dtype, FP8_DTYPE, pages))
    return record


def run(device: torch.device, quick: bool, out: str | None) -> ResultRecord:
    on_gpu = device.type == "cuda"
    dtype = torch.float16 if on_gpu else torch.float32
    record = ResultRecord(PROJECT, "fp8 kv decode", device,
                          f"fp8 e4m3 cache with per-page scales vs the {str(dtype).replace('torch.', '')} cache, "
                          f"head_dim {HEAD_DIM}, block_size {BLOCK_SIZE}; GB/s = paged_attention.bytes_moved "
                          "with the fp8 cache (K/V + page scales + q + out + table + seq_lens bytes)")
    long_context = []
    for layout, (num_q_heads, num_kv_heads) in LAYOUTS.items():
        if not on_gpu:
            num_q_heads, num_kv_heads = num_q_heads // 4, num_kv_heads // 4 or 1
        for batch, context in sweep(device, quick):
            if _paged.kv_bytes(batch, context, num_kv_heads, dtype) > _paged.MAX_KV_BYTES:
                continue
            case = measure(record, layout, batch, context, num_q_heads, num_kv_heads, dtype, device)
            if context >= 8192:
                long_context.append(case)
            if on_gpu:
                torch.cuda.empty_cache()
    saved = {f"bs{b}_hd{h}": round(pct, 2) for b, h, pct in storage_table()}
    print("storage saved vs fp16 (K+V+scales): " + ", ".join(f"{k} {v}%" for k, v in saved.items()))
    record.record["storage_saved_percent"] = saved
    if long_context:
        worst = min(long_context, key=lambda c: c["speedup"]["fp16 paged decode"])
        record.set_headline(
            f"context >= 8K: fp8 decode {worst['speedup']['fp16 paged decode']:.2f}x fp16 in the worst case "
            f"({worst['name']}); storage saved at block 16 / head_dim 128: {saved['bs16_hd128']}%",
            speedup=worst["speedup"]["fp16 paged decode"], baseline="fp16 paged decode")
    record.emit(out)
    write_record(device, quick, dtype).emit(out)
    return record


if __name__ == "__main__":
    raise SystemExit(benchmark_main(__doc__, run))
