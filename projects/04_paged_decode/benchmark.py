"""Project 04 benchmark: paged decode attention vs a materialising reference, SDPA over gathered KV, and
FlashInfer's batch decode when it is importable.

    python projects/04_paged_decode/benchmark.py [--quick] [--out results]

Bytes per call: kernel_lab.ops.paged_attention.bytes_moved (every attended K and V row once, q, the output,
the used table entries and seq_lens). The K/V term dominates, so GB/s against the measured copy bandwidth is
the figure of merit; GQA reads num_q_heads / num_kv_heads times fewer bytes for the same work.
Pages are a random permutation of the pool, so no two consecutive blocks are adjacent in memory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernel_lab.harness.bench import benchmark as _benchmark  # noqa: E402
from kernel_lab.harness.bench import benchmark_main, inputs_for_rotation  # noqa: E402
from kernel_lab.harness.results import ResultRecord  # noqa: E402
from kernel_lab.harness.testing import error_report  # noqa: E402
from kernel_lab.ops import allocate_kv_cache, paged_decode_attention  # noqa: E402
from kernel_lab.ops.kv_cache import FP8_DTYPE, kv_cache_bytes  # noqa: E402
from kernel_lab.ops.paged_attention import bytes_moved, paged_decode_attention_reference  # noqa: E402

PROJECT = "04_paged_decode"
HEAD_DIM, BLOCK_SIZE = 128, 16
LAYOUTS = {"MHA": (32, 32), "GQA 8:1": (32, 4)}  # (num_q_heads, num_kv_heads)
MAX_KV_BYTES = 8 << 30      # skip sweep points whose cache would not fit comfortably twice (SDPA copy)
REFERENCE_MAX_BYTES = 1 << 29  # the materialising reference copies K/V to fp32: only time it on small caches


def benchmark(fn, **kwargs):
    """The harness timer; CPU runs are functional only, so they stop early."""
    return _benchmark(fn, cpu_max_seconds=0.3, **kwargs)


def kv_bytes(batch: int, context: int, num_kv_heads: int, cache_dtype: torch.dtype) -> int:
    """The pool `build_case` allocates (every sequence's pages, K and V): what must fit the device."""
    return kv_cache_bytes(batch * -(-context // BLOCK_SIZE), BLOCK_SIZE, num_kv_heads, HEAD_DIM, cache_dtype)


def call_bytes(batch, context, num_q_heads, num_kv_heads, dtype, cache_dtype=None) -> int:
    """bytes_moved of one call on a `build_case` case (every sequence `context` long)."""
    return bytes_moved([context] * batch, num_q_heads, num_kv_heads, HEAD_DIM, BLOCK_SIZE, dtype, cache_dtype)


def build_case(batch, context, num_q_heads, num_kv_heads, dtype, device, cache_dtype=None, seed=0):
    """Random q and a paged cache whose pages are a random permutation of the pool; all lengths = context.
    FP8 caches get random E4M3 bytes and random power-of-two page scales (speed runs only)."""
    cache_dtype = cache_dtype or dtype
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    k, v, k_scale, v_scale = allocate_kv_cache(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, cache_dtype, device)
    for cache in (k, v):
        if cache_dtype == FP8_DTYPE:
            cache.copy_(torch.randn(cache.shape, device=device).clamp(-448, 448).to(FP8_DTYPE))
        else:
            cache.normal_()
    if k_scale is not None:
        for scale in (k_scale, v_scale):
            scale.copy_(torch.exp2(torch.randint(-8, -2, scale.shape, device=device).float()))
    tables = torch.randperm(num_blocks, generator=g).view(batch, blocks_per_seq).to(torch.int32).to(device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn((batch, num_q_heads, HEAD_DIM), generator=g).to(dtype=dtype, device=device)
    return q, k, v, tables, seq_lens, k_scale, v_scale


def gathered(k_cache, tables, context):
    """[batch, kv_heads, context, head_dim] contiguous copy of every sequence's K (or V)."""
    batch = tables.shape[0]
    pages = tables.long()[:, : -(-context // BLOCK_SIZE)]
    rows = k_cache[pages].flatten(1, 2)[:, :context]                         # [B, T, H, D]
    return rows.transpose(1, 2).contiguous().view(batch, k_cache.shape[2], context, HEAD_DIM)


def flashinfer_decode(q, k, v, tables, seq_lens, num_q_heads, num_kv_heads):
    """A closure running FlashInfer's batch decode on the same cache (NHD layout = ours), or None."""
    try:
        import flashinfer

        batch, blocks = tables.shape
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        indptr = torch.arange(0, (batch + 1) * blocks, blocks, dtype=torch.int32, device=q.device)
        last = (seq_lens - 1) % BLOCK_SIZE + 1
        wrapper.plan(indptr, tables.flatten().contiguous(), last.to(torch.int32), num_q_heads, num_kv_heads,
                     HEAD_DIM, BLOCK_SIZE, data_type=q.dtype, q_data_type=q.dtype)
        out = torch.empty_like(q)
        wrapper.run(q, (k, v), out=out)
        return lambda: wrapper.run(q, (k, v), out=out)
    except Exception as exc:  # noqa: BLE001 - an optional baseline
        print(f"(FlashInfer baseline unavailable: {type(exc).__name__}: {str(exc)[:120]})")
        return None


def sweep(device: torch.device, quick: bool):
    if device.type != "cuda":
        return [(1, 128), (2, 256)]
    if quick:
        return [(1, 32768), (64, 2048), (16, 8192), (256, 512)]
    return [(b, c) for b in (1, 4, 16, 64, 256) for c in (128, 512, 2048, 8192, 32768)]


def run(device: torch.device, quick: bool, out: str | None, dtype=torch.bfloat16) -> ResultRecord:
    on_gpu = device.type == "cuda"
    record = ResultRecord(PROJECT, "paged decode bandwidth", device,
                          f"{str(dtype).replace('torch.', '')} q/cache, head_dim {HEAD_DIM}, block_size "
                          f"{BLOCK_SIZE}, 32 query heads; GB/s = paged_attention.bytes_moved (K/V + q + out + "
                          "table + seq_lens bytes) per call")
    headline_cases = []
    for layout, (num_q_heads, num_kv_heads) in LAYOUTS.items():
        if not on_gpu:
            num_q_heads, num_kv_heads = num_q_heads // 4, num_kv_heads // 4 or 1
        for batch, context in sweep(device, quick):
            cache_bytes = kv_bytes(batch, context, num_kv_heads, dtype)
            if cache_bytes > MAX_KV_BYTES:
                continue
            copies = inputs_for_rotation(cache_bytes) if on_gpu else 1
            cases = [build_case(batch, context, num_q_heads, num_kv_heads, dtype, device, seed=i)
                     for i in range(copies)]
            outs = [torch.empty_like(c[0]) for c in cases]
            label = f"{layout} batch={batch} ctx={context}"
            timing = benchmark([lambda c=c, o=o: paged_decode_attention(*c[:5], out=o) for c, o in zip(cases, outs)],
                               device=device, name=f"kernel_lab {label}")
            q, k, v, tables, seq_lens, _, _ = cases[0]
            baselines, extra = {}, {}
            if on_gpu:  # the CUDA kernel's other variant (the CPU paths have one implementation)
                baselines["pipelined variant (cp.async)"] = benchmark(
                    [lambda c=c, o=o: paged_decode_attention(*c[:5], out=o, variant="pipelined")
                     for c, o in zip(cases, outs)], device=device, name=f"kernel_lab pipelined {label}")
            dense_k, dense_v = gathered(k, tables, context), gathered(v, tables, context)
            q4 = q.view(batch, num_q_heads, 1, HEAD_DIM)
            gqa = num_q_heads != num_kv_heads
            baselines["SDPA (gathered KV)"] = benchmark(
                lambda dk=dense_k, dv=dense_v: torch.nn.functional.scaled_dot_product_attention(
                    q4, dk, dv, enable_gqa=gqa),
                device=device, name=f"sdpa {label}")
            del dense_k, dense_v
            if cache_bytes <= REFERENCE_MAX_BYTES:
                baselines["materialising reference"] = benchmark(
                    lambda: paged_decode_attention_reference(q, k, v, tables, seq_lens), device=device,
                    name=f"reference {label}")
                reference = paged_decode_attention_reference(q, k, v, tables, seq_lens)
                report = error_report(paged_decode_attention(q, k, v, tables, seq_lens), reference.double())
                extra["error_vs_reference"] = {"rel_l2": report.rel_l2, "max_abs": report.max_abs}
            if on_gpu:
                fi = flashinfer_decode(q, k, v, tables, seq_lens, num_q_heads, num_kv_heads)
                if fi is not None:
                    baselines["FlashInfer"] = benchmark(fi, device=device, name=f"flashinfer {label}")
            nbytes = call_bytes(batch, context, num_q_heads, num_kv_heads, dtype)
            case = record.add_case(label, shape={"layout": layout, "batch": batch, "context": context,
                                                 "num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads,
                                                 "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE},
                                   dtype=str(dtype).replace("torch.", ""), timing=timing, nbytes=nbytes,
                                   baselines=baselines, extra=extra)
            if batch * context >= 64 * 2048 or (batch == 1 and context >= 32768):
                headline_cases.append(case)
            del cases, outs
            if on_gpu:
                torch.cuda.empty_cache()
    if headline_cases:
        worst = min(headline_cases, key=lambda c: c["percent_of_ceiling"])
        by_layout = {}
        for c in headline_cases:
            by_layout.setdefault(c["shape"]["layout"], []).append(c["percent_of_ceiling"])
        means = {k: sum(v) / len(v) for k, v in by_layout.items()}
        record.set_headline(
            f"batch x context >= 64 x 2K or batch 1 at 32K: worst {worst['percent_of_ceiling']:.1f}% of copy "
            f"bandwidth ({worst['name']}); mean " + ", ".join(f"{k} {v:.1f}%" for k, v in means.items()),
            percent_of_ceiling=worst["percent_of_ceiling"])
    record.emit(out)
    return record


if __name__ == "__main__":
    raise SystemExit(benchmark_main(__doc__, run, run_options=lambda args, device: {
        "dtype": torch.bfloat16 if device.type == "cuda" else torch.float32}))
