"""Batch-1 decode attention at long context on the CPU: the C kernel's context splits over the thread pool
against the same kernel on one thread, as % of the machine's measured read bandwidth (issue 35 item 3).

    python projects/04_paged_decode/cpu_long_context.py [--contexts 1024 8192 32768] [--threads 1 2]
        [--formats float32 float16 int8 fp8] [--out results]

One layer of the 1.2B Llama shape the engine's long-context records use (32 query heads, 8 KV heads,
head_dim 64, 16-token pages, pages shuffled in the pool), one query token, float32 q and out. Per point,
alternating the two calls: `kl_paged_decode_attention` with `threads` of the pool's threads, and with one
(the kernel before the splits, a context within one span computes the same way). bytes_moved is what the
call must read: every K and V element of the context in its page format, int8's scales per token, head and 16
channels and fp8's per page, q and the output row; % is of `measure_read_bandwidth(threads)` measured in the same
run (a sum over 512 MiB with that many threads). A layer's KV at 32K context in float32 is 128 MiB, past any
cache; at 1K (4 MiB) it may sit in L2/L3, where more than 100% of the read ceiling is possible.
Our own harness: llama.cpp has no tool that times its attention alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernel_lab.harness.bench import benchmark  # noqa: E402
from kernel_lab.harness.results import ResultRecord, device_label  # noqa: E402
from kernel_lab.harness.roofline import achieved_gbps, measure_read_bandwidth, percent_of  # noqa: E402
from kernel_lab.ops import allocate_kv_cache, cpu_kernels  # noqa: E402
from kernel_lab.ops.kv_cache import FP8_DTYPE, int8_groups, write_kv_reference  # noqa: E402

FORMATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
           "fp8": FP8_DTYPE}
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 64, 16


def bytes_moved(context: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    kv = 2 * context * NUM_KV_HEADS * HEAD_DIM * element
    pages = -(-context // BLOCK_SIZE)
    scales = (2 * context * NUM_KV_HEADS * int8_groups(HEAD_DIM) * 4 if dtype == torch.int8 else
              2 * pages * NUM_KV_HEADS * 4 if dtype == FP8_DTYPE else 0)
    return kv + scales + 2 * NUM_Q_HEADS * HEAD_DIM * 4 + pages * 4


def case(context: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pages = -(-context // BLOCK_SIZE)
    k_cache, v_cache, k_scale, v_scale = allocate_kv_cache(pages, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)
    table = torch.randperm(pages, generator=g).to(torch.int32)[None]
    if dtype in (torch.int8, FP8_DTYPE):
        slots = (table[0].long()[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()[:context]
        for start in range(0, context, 4096):  # the reference writes in chunks (memory)
            rows = slots[start:start + 4096]
            write_kv_reference(torch.randn(len(rows), NUM_KV_HEADS, HEAD_DIM, generator=g),
                               torch.randn(len(rows), NUM_KV_HEADS, HEAD_DIM, generator=g),
                               k_cache, v_cache, rows, k_scale, v_scale)
    else:
        k_cache.copy_(torch.randn(k_cache.shape, generator=g).to(dtype))
        v_cache.copy_(torch.randn(v_cache.shape, generator=g).to(dtype))
    q = torch.randn(1, NUM_Q_HEADS, HEAD_DIM, generator=g)
    return q, k_cache, v_cache, k_scale, v_scale, table, torch.tensor([context], dtype=torch.int32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 32768])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--formats", nargs="+", default=["float32", "float16", "int8", "fp8"], choices=FORMATS)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    lib = cpu_kernels.load_library()
    if lib is None:
        raise SystemExit("the CPU kernels could not be built")
    torch.set_num_threads(1)  # the kernel's threads are the pool's; torch's own stay out of the way
    read = {t: measure_read_bandwidth(t) for t in args.threads}
    record = ResultRecord("04_paged_decode", "cpu long-context decode attention", "cpu",
                          "batch 1, one layer of the 1.2B Llama shape (32 q heads, 8 KV heads, head_dim 64, "
                          "16-token pages), kl_paged_decode_attention with N pool threads vs 1 thread, alternating; "
                          "% of ceiling is of the read bandwidth measured with N threads in the same run "
                          f"(ISA path {lib.kl_paged_attention_isa().decode()})")
    record.record["ceilings"]["read"] = {str(t): r for t, r in read.items()}
    for name in args.formats:
        dtype = FORMATS[name]
        for context in args.contexts:
            q, kc, vc, ks, vs, table, lens = case(context, dtype)
            out = torch.empty_like(q)

            def call(threads, args=(q, kc, vc, table, lens, HEAD_DIM ** -0.5, out), scales=(ks, vs)):
                return lambda: cpu_kernels.paged_decode_attention_cpu(*args, k_scale=scales[0], v_scale=scales[1],
                                                                      threads=threads)
            nbytes = bytes_moved(context, dtype)
            for threads in args.threads:
                # alternate: one timing of each, twice, keeping each side's faster-median run
                timings = {}
                for side in ("ours", "one", "ours", "one"):
                    t = benchmark(call(threads if side == "ours" else 1), device="cpu", rep=50, cpu_max_seconds=1.5)
                    if side not in timings or t.median_ms < timings[side].median_ms:
                        timings[side] = t
                c = record.add_case(f"{name} context={context} threads={threads}",
                                    shape={"context": context, "threads": threads, "num_q_heads": NUM_Q_HEADS,
                                           "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                                           "block_size": BLOCK_SIZE, "batch": 1},
                                    dtype=name, timing=timings["ours"], nbytes=nbytes,
                                    baselines={"same kernel on 1 thread": timings["one"]})
                c["ceiling"] = f"read bandwidth, {threads} thread(s)"
                c["percent_of_ceiling"] = percent_of(c["metric"]["value"], read[threads]["GBps"])
                c["one_thread_percent_of_read_ceiling_1"] = percent_of(
                    achieved_gbps(nbytes, timings["one"].median_ms), read[1]["GBps"]) if 1 in read else None
    long = [c for c in record.record["cases"] if c["shape"]["context"] >= 8192]
    if long:
        worst = min(long, key=lambda c: c["percent_of_ceiling"])
        record.set_headline(f"batch-1 attention at context >= 8K: worst {worst['percent_of_ceiling']:.1f}% of the "
                            f"read bandwidth ({worst['name']}) on {device_label(record.env)}",
                            worst_percent=worst["percent_of_ceiling"], worst_case=worst["name"])
    print(record.table())
    record.write(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
