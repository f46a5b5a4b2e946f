"""A small case for compute-sanitizer (memcheck, racecheck): every code path of the extension once.

    compute-sanitizer --tool memcheck python3 projects/04_paged_decode/sanitizer_case.py [--part decode|fp8]

Run with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (gpu_checks.sh does) so every tensor is its own allocation and an
out-of-bounds access cannot land silently inside a neighbouring tensor. Exits non-zero on a wrong result.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernel_lab.ops import allocate_kv_cache, paged_decode_attention, write_kv  # noqa: E402
from kernel_lab.ops.kv_cache import FP8_DTYPE, write_kv_reference  # noqa: E402
from kernel_lab.ops.paged_attention import paged_decode_attention_reference, plan_splits  # noqa: E402


def decode_case(dtype, cache_dtype, num_q_heads, num_kv_heads, head_dim, block_size, lengths, max_blocks):
    g = torch.Generator().manual_seed(len(lengths) * 1000 + head_dim + block_size)
    num_blocks = len(lengths) * max_blocks + 1
    k, v, ks, vs = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, "cuda")
    slots = torch.arange(num_blocks * block_size, device="cuda")
    key = torch.randn((slots.numel(), num_kv_heads, head_dim), generator=g).to(device="cuda")
    value = torch.randn((slots.numel(), num_kv_heads, head_dim), generator=g).to(device="cuda")
    src = torch.float32 if cache_dtype == FP8_DTYPE else cache_dtype
    write_kv(key.to(src), value.to(src), k, v, slots, ks, vs)
    tables = torch.randperm(num_blocks - 1, generator=g)[: len(lengths) * max_blocks].view(len(lengths), max_blocks)
    tables = tables.to(torch.int32).cuda()
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn((len(lengths), num_q_heads, head_dim), generator=g).to(dtype=dtype, device="cuda")
    out = paged_decode_attention(q, k, v, tables, seq_lens, k_scale=ks, v_scale=vs, validate=True)
    # The reference runs on CPU copies: under the sanitizer, every extra CUDA library costs seconds.
    cpu = [t.cpu() if t is not None else None for t in (q, k, v, tables, seq_lens, ks, vs)]
    expected = paged_decode_attention_reference(*cpu[:5], None, *cpu[5:])
    err = (out.cpu().float() - expected.float()).abs().max().item()
    plan = plan_splits(len(lengths), num_q_heads, num_kv_heads, max_blocks, block_size,
                       torch.cuda.get_device_properties(0).multi_processor_count)
    print(f"decode {dtype} cache={cache_dtype} hq={num_q_heads} hkv={num_kv_heads} d={head_dim} bs={block_size} "
          f"splits={plan.num_splits}: max abs err {err:.2e}")
    return err < 2e-2


def fp8_write_case():
    """Appends that grow a page's scale, skipped slots, a prefill into fresh pages: GPU == CPU bit for bit."""
    ok = True
    for head_dim in (64, 96, 128, 256):
        cpu = allocate_kv_cache(6, 16, 2, head_dim, FP8_DTYPE, "cpu")
        gpu = allocate_kv_cache(6, 16, 2, head_dim, FP8_DTYPE, "cuda")
        g = torch.Generator().manual_seed(head_dim)
        for step, slots in enumerate(([0, 1, 2, 17, -1, 40], [3], [4, 95], list(range(48, 64)))):
            slot_t = torch.tensor(slots)
            key = torch.randn((len(slots), 2, head_dim), generator=g) * 4.0 ** step
            value = torch.randn((len(slots), 2, head_dim), generator=g) * 2.0 ** -step
            write_kv_reference(key, value, *cpu[:2], slot_t, *cpu[2:])
            write_kv(key.cuda(), value.cuda(), *gpu[:2], slot_t.cuda(), *gpu[2:])
        same = all(torch.equal(a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                               (b.view(torch.uint8) if b.dtype == FP8_DTYPE else b).cpu()) for a, b in zip(cpu, gpu))
        print(f"fp8 write_kv head_dim={head_dim}: GPU {'matches' if same else 'DIFFERS FROM'} the CPU reference")
        ok &= same
    return ok


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=["decode", "fp8", "all"], default="all")
    args = parser.parse_args()
    ok = True
    if args.part in ("decode", "all"):
        for dtype in (torch.float16, torch.bfloat16):
            ok &= decode_case(dtype, dtype, 8, 8, 128, 16, [1, 17, 0, 200], 16)        # MHA, split path
            ok &= decode_case(dtype, dtype, 16, 2, 64, 8, [9, 64], 8)                # GQA 8:1
        ok &= decode_case(torch.float16, torch.float16, 6, 2, 256, 64, [130, 3], 3)    # odd group (tile 4)
        ok &= decode_case(torch.bfloat16, torch.bfloat16, 20, 1, 128, 32, [40], 2)    # two head groups
    if args.part in ("fp8", "all"):
        ok &= decode_case(torch.bfloat16, FP8_DTYPE, 8, 2, 128, 16, [300, 1, 16, 17], 20)
        ok &= decode_case(torch.float16, FP8_DTYPE, 4, 4, 64, 32, [70, 0], 3)
        ok &= fp8_write_case()
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
