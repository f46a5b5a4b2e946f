"""The CPU paged attention's context splits (csrc/cpu/paged_decode_attention.c, "Splits"): a sequence's pages
are cut at fixed multiples of SPLIT_TOKENS, each span attended on its own and merged by log-sum-exp, and the
spans run on gguf_linear's thread pool. What must hold, on every ISA build and page format: the same bits for
any thread count and any batch around a sequence (the cut points depend on its length, window and block size
only), and the float64 reference's result within float32's tolerance at lengths on both sides of the cut
points, with windows that begin inside a span."""

from __future__ import annotations

import pytest
import torch

from kernel_lab.harness.testing import ISA_BUILDS, assert_close, case_seed, generator, poison, randn
from kernel_lab.ops import allocate_kv_cache, cpu_kernels
from kernel_lab.ops.kv_cache import FP8_DTYPE, dequantize_pages, element_scales, int8_rows, write_kv_reference
from kernel_lab.ops.paged_attention import paged_decode_attention_reference

FORMATS = [torch.float32, torch.float16, torch.bfloat16, torch.int8, FP8_DTYPE]


@pytest.fixture(params=ISA_BUILDS, scope="module")
def lib(request, isa_build):
    return isa_build("paged_decode_attention", request.param)


def paged_case(seed, lengths, dtype, num_q_heads, num_kv_heads, head_dim, block_size):
    """Shuffled pages holding random K/V for each sequence (written by the reference for int8 and fp8), and
    the float64 K/V the pages hold."""
    g = generator(seed)
    needed = [max(1, -(-n // block_size)) for n in lengths]
    num_blocks = sum(needed) + 2
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(lengths), max(needed)), -1, dtype=torch.int32)
    for b, n in enumerate(needed):
        tables[b, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
    slots = torch.cat([tables[b].long()[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
                       for b, n in enumerate(lengths)])
    k = randn((len(slots), num_kv_heads, head_dim), torch.float32, "cpu", seed + 1) * 2
    v = randn((len(slots), num_kv_heads, head_dim), torch.float32, "cpu", seed + 2)
    k[::5] *= 6.0  # rows of several ranges, so spans' maxima differ and the merge's weights matter
    kc, vc, ks, vs = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    kc.view(torch.uint8).copy_(torch.randint(0, 256, kc.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
    if dtype in (torch.int8, FP8_DTYPE):
        write_kv_reference(k, v, kc, vc, slots, ks, vs)
        kd = dequantize_pages(kc, element_scales(ks, dtype, head_dim)).double()
        kd = int8_rows(kd).double() if dtype == torch.int8 else kd
        vd = dequantize_pages(vc, element_scales(vs, dtype, head_dim)).double()
        vd = int8_rows(vd).double() if dtype == torch.int8 else vd
    else:
        kc.view(-1, num_kv_heads, head_dim)[slots] = k.to(dtype)
        vc.view(-1, num_kv_heads, head_dim)[slots] = v.to(dtype)
        kd, vd = kc.double(), vc.double()
    return kc, vc, ks, vs, kd, vd, tables, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("dtype", FORMATS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("block_size, window", [(16, 0), (16, 700), (8, 0), (32, 333)])
def test_split_context_is_the_reference_and_the_same_bits_for_any_thread_count(lib, dtype, block_size, window):
    split = lib.kl_paged_attention_split_tokens()
    lengths = [split - 1, split, split + 1, 1, 3 * split + 5, 0, 2 * split + block_size // 2]
    hq, hkv, d = 6, 2, 64
    seed = case_seed("split-context", str(dtype), block_size, window)
    kc, vc, ks, vs, kd, vd, tables, lens = paged_case(seed, lengths, dtype, hq, hkv, d, block_size)
    q = randn((len(lengths), hq, d), torch.float32, "cpu", seed + 3)
    outs = []
    for threads in (1, 2, 3, 5):
        out = poison(torch.empty_like(q))
        assert cpu_kernels.paged_decode_attention_cpu(q, kc, vc, tables, lens, d ** -0.5, out, window, library=lib,
                                                      k_scale=ks, v_scale=vs, threads=threads)
        outs.append(out)
    for threads, out in zip((2, 3, 5), outs[1:]):
        assert torch.equal(out, outs[0]), threads
    expected = paged_decode_attention_reference(q.double(), kd, vd, tables, lens, d ** -0.5,
                                                sliding_window=window or None)
    assert_close(outs[0], expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=["float32", "bfloat16", "int8"])
def test_a_long_sequence_gets_the_same_bits_alone_and_in_any_batch(lib, dtype):
    """Batch invariance through the split: the long row alone on one thread equals the same row among short and
    long neighbours on two threads, whichever thread its spans land on."""
    split = lib.kl_paged_attention_split_tokens()
    lengths = [5, 4 * split + 3, 17, split + 1]
    hq, hkv, d, block_size = 4, 4, 40, 16
    kc, vc, ks, vs, _, _, tables, lens = paged_case(case_seed("split-batch", str(dtype)), lengths, dtype,
                                                    hq, hkv, d, block_size)
    q = randn((len(lengths), hq, d), torch.float32, "cpu", 9)
    batch_out = poison(torch.empty_like(q))
    assert cpu_kernels.paged_decode_attention_cpu(q, kc, vc, tables, lens, 0.2, batch_out, library=lib,
                                                  k_scale=ks, v_scale=vs, threads=2)
    for b in range(len(lengths)):
        alone = poison(torch.empty_like(q[b:b + 1]))
        assert cpu_kernels.paged_decode_attention_cpu(q[b:b + 1], kc, vc, tables[b:b + 1], lens[b:b + 1], 0.2, alone,
                                                      library=lib, k_scale=ks, v_scale=vs, threads=1)
        assert torch.equal(alone[0], batch_out[b]), b


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8], ids=["float16", "int8"])
def test_fused_call_is_the_same_bits_for_any_thread_count(lib, dtype):
    """kl_rope_write_paged_attention over a long prompt's last rows: cache bytes and outputs equal for 1 and 3
    threads (int8 rows attend one after another, 16-bit rows together)."""
    split = lib.kl_paged_attention_split_tokens()
    hq, hkv, d, block_size = 4, 2, 64, 16
    length = 2 * split + 7
    kc0, vc0, ks0, vs0, _, _, tables, _ = paged_case(case_seed("split-fused", str(dtype)), [length], dtype,
                                                     hq, hkv, d, block_size)
    rows = 3  # the prompt's last 3 tokens, written and attended by the call
    positions = torch.arange(length - rows, length)
    slots = tables[0].long()[positions // block_size] * block_size + positions % block_size
    lens = (positions + 1).to(torch.int32)
    qkv = randn((rows, (hq + 2 * hkv) * d), torch.float32, "cpu", 5)
    angles = positions.float()[:, None] * (10000.0 ** (-torch.arange(0, d, 2).float() / d))[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    results = []
    for threads in (1, 3):
        kc, vc = kc0.clone(), vc0.clone()
        ks, vs = (None, None) if ks0 is None else (ks0.clone(), vs0.clone())
        out = poison(torch.empty(rows, hq * d))
        cpu_kernels.rope_write_paged_attention_cpu(qkv, cos, sin, slots, kc, vc, tables.expand(rows, -1).contiguous(),
                                                   lens, hq, d ** -0.5, out, library=lib, k_scale=ks, v_scale=vs,
                                                   threads=threads)
        results.append((out, kc, vc))
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           b.view(torch.uint8) if b.dtype != torch.float32 else b)
