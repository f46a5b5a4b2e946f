"""Project 04 correctness: paged decode attention.

CPU: the reference path (what `paged_decode_attention` runs on CPU for fp16/bf16) and the plain-C kernel
(fp32; csrc/cpu, skipped without a C compiler) against an independent float64 formulation, with unread
slots poisoned; the dispatch between the two; the CPU model of the CUDA kernel's algorithm against the
reference; the split plan; input validation; and nvcc builds of the torch-free kernel sources for
sm_80/89/90 with zero spills.
GPU (marked): the real extension against the reference, including inside a CUDA graph.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from kernel_lab.harness.testing import assert_close, case_seed, generator, poison, randn
from kernel_lab.ops import allocate_kv_cache, cpu_kernels, paged_attention, paged_decode_attention, write_kv
from kernel_lab.ops.paged_attention import (
    HEADS_PER_GROUP,
    MIN_PARTITION_TOKENS,
    SplitPlan,
    check_table_values,
    kernel_model,
    paged_decode_attention_reference,
    plan_splits,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# --------------------------------------------------------------------------------------------- helpers
def attention64(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=None, v_scale=None, window=None):
    """Float64, one sequence and one head at a time, token by token through the block table; with a sliding
    `window` W the query (position length - 1) sees the positions t with length - 1 - t < W."""
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros((batch, num_q_heads, head_dim), dtype=torch.float64)
    for b in range(batch):
        length = int(seq_lens[b])
        if length == 0:
            continue
        seen = [t for t in range(length) if not window or (length - 1) - t < window]
        pages = [int(block_tables[b, t // block_size]) for t in seen]
        offsets = [t % block_size for t in seen]
        k = torch.stack([k_cache[p, o].double() for p, o in zip(pages, offsets)])       # [L, Hkv, D]
        v = torch.stack([v_cache[p, o].double() for p, o in zip(pages, offsets)])
        if k_scale is not None:
            k = k * torch.stack([k_scale[p].double() for p in pages])[..., None]
            v = v * torch.stack([v_scale[p].double() for p in pages])[..., None]
        for h in range(num_q_heads):
            logits = k[:, h // group] @ q[b, h].double() * scale
            weights = torch.exp(logits - logits.max())
            out[b, h] = (weights / weights.sum()) @ v[:, h // group]
    return out


def make_case(seed, *, batch, num_q_heads, num_kv_heads, head_dim, block_size, lengths, max_blocks=None,
              dtype=torch.float16, cache_dtype=None, shared=True, device="cpu", num_blocks=None):
    """Random paged inputs: a shuffled pool, prefix blocks shared between sequences, -1 padding past each
    sequence's last block, and the cache filled through write_kv (fp8 pages get real page scales)."""
    cache_dtype = cache_dtype or dtype
    needed = [-(-n // block_size) for n in lengths]
    max_blocks = max_blocks or max(max(needed), 1)
    num_blocks = num_blocks or sum(needed) + 3
    g = generator(seed)
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    owned = []
    for b, n in enumerate(needed):
        row = [pool.pop() for _ in range(n)]
        if shared and b > 0 and needed[0] > 0 and n > 1:
            row[0] = int(tables[0, 0])  # a shared prefix block
        tables[b, :n] = torch.tensor(row, dtype=torch.int32)
        owned.append(row)
    k_cache, v_cache, k_scale, v_scale = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim,
                                                           cache_dtype, "cpu")
    # Fill every slot of the pool, so masked tails hold real data a kernel would wrongly include.
    slots = torch.arange(num_blocks * block_size, dtype=torch.int64)
    src_dtype = dtype if cache_dtype != torch.float8_e4m3fn else torch.float32
    keys = randn((slots.numel(), num_kv_heads, head_dim), src_dtype, "cpu", seed + 1)
    values = randn((slots.numel(), num_kv_heads, head_dim), src_dtype, "cpu", seed + 2)
    if cache_dtype == torch.float8_e4m3fn:
        write_kv(keys, values, k_cache, v_cache, slots, k_scale, v_scale)  # the CPU reference of the policy
    else:
        k_cache.view(-1, num_kv_heads, head_dim).copy_(keys)  # slot = block * block_size + offset
        v_cache.view(-1, num_kv_heads, head_dim).copy_(values)
    q = randn((batch, num_q_heads, head_dim), dtype, "cpu", seed + 3)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    tensors = [q, k_cache, v_cache, tables, seq_lens, k_scale, v_scale]
    return [t.to(device) if t is not None else None for t in tensors]


# --------------------------------------------------------------------------------------------- reference
# Every GQA ratio (MHA, 2, 4, a non-power-of-two 7, 8, 12, 16, MQA 32), each block size and head dim, lengths
# 1, block_size, block_size + 1 and the table's maximum in one batch.
REFERENCE_CASES = [
    # (num_q_heads, num_kv_heads, head_dim, block_size)
    (4, 4, 64, 8), (8, 4, 128, 16), (8, 2, 64, 32), (14, 2, 128, 64), (16, 2, 64, 16), (16, 1, 256, 8),
    (32, 1, 64, 8), (12, 1, 128, 32), (6, 2, 96, 16),  # 96: Phi-3
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, block_size", REFERENCE_CASES)
def test_reference_matches_float64(num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    max_blocks = 5
    lengths = [1, block_size, block_size + 1, max_blocks * block_size, 3 * block_size - 2]
    seed = case_seed("ref", num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    q, kc, vc, bt, sl, ks, vs = make_case(seed, batch=len(lengths), num_q_heads=num_q_heads,
                                          num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                                          lengths=lengths, max_blocks=max_blocks, dtype=dtype)
    out = poison(torch.empty_like(q))
    result = paged_decode_attention(q, kc, vc, bt, sl, out=out)
    assert result.data_ptr() == out.data_ptr() and result.dtype == dtype
    assert_close(out, attention64(q, kc, vc, bt, sl, head_dim ** -0.5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_custom_scale_and_long_context(dtype):
    lengths = [2000, 1, 777]
    q, kc, vc, bt, sl, _, _ = make_case(case_seed("long", dtype), batch=3, num_q_heads=8, num_kv_heads=2,
                                        head_dim=64, block_size=64, lengths=lengths, dtype=dtype)
    q = q * 4  # peaky softmax
    out = paged_decode_attention(q, kc, vc, bt, sl, scale=0.3)
    assert_close(out, attention64(q, kc, vc, bt, sl, 0.3), dtype)


def test_zero_length_rows_are_zero_and_padding_is_never_read():
    q, kc, vc, bt, sl, _, _ = make_case(5, batch=3, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                                        lengths=[17, 0, 3], max_blocks=4, dtype=torch.float32)
    assert int(bt[1, 0]) == -1 and int(bt[0, 3]) == -1  # padding entries are -1: reading one would fail
    out = paged_decode_attention(q, kc, vc, bt, sl)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out, attention64(q, kc, vc, bt, sl, 64 ** -0.5), torch.float32)


def test_strided_q_out_and_interleaved_cache_layout():
    """q sliced out of a fused QKV buffer, out a strided view, K/V as views of one [N, 2, bs, H, D] pool."""
    num_blocks, block_size, heads, head_dim = 12, 16, 2, 64
    pool = randn((num_blocks, 2, block_size, heads, head_dim), torch.float16, "cpu", 3)
    kc, vc = pool[:, 0], pool[:, 1]
    qkv = randn((3, 8 + 2 * heads, head_dim), torch.float16, "cpu", 4)
    q = qkv[:, :8]
    bt = torch.tensor([[3, 7, 1], [0, 11, -1], [5, -1, -1]], dtype=torch.int32)
    sl = torch.tensor([40, 20, 9], dtype=torch.int32)
    out_base = poison(torch.empty((3, 8, 2 * head_dim), dtype=torch.float16))
    out = out_base[:, :, :head_dim]
    paged_decode_attention(q, kc, vc, bt, sl, out=out)
    assert_close(out, attention64(q, kc, vc, bt, sl, head_dim ** -0.5), torch.float16)
    assert torch.isnan(out_base[:, :, head_dim:].float()).all(), "wrote outside out"


def test_inputs_are_not_modified():
    q, kc, vc, bt, sl, _, _ = make_case(9, batch=2, num_q_heads=4, num_kv_heads=1, head_dim=128, block_size=8,
                                        lengths=[9, 30], dtype=torch.bfloat16)
    before = [t.clone() for t in (q, kc, vc, bt, sl)]
    paged_decode_attention(q, kc, vc, bt, sl)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, kc, vc, bt, sl)))


# --------------------------------------------------------------------------------------------- CPU C kernel
@pytest.fixture
def c_kernel(monkeypatch):
    """The plain-C CPU kernel (csrc/cpu), built if needed; skips without a C compiler, fails if one is there
    but the build does not work."""
    monkeypatch.delenv("KERNEL_LAB_CPU_KERNELS", raising=False)
    if cpu_kernels.compiler() is None:
        pytest.skip("no C compiler ($CC or cc on PATH) to build kernel_lab/csrc/cpu")
    assert cpu_kernels.load_library() is not None, "a C compiler is on PATH but the CPU kernel did not build"
    return cpu_kernels.paged_decode_attention_cpu


def poison_unread_slots(k_cache, v_cache, block_tables, seq_lens, window=None):
    """NaN in every slot no sequence may read (pages of no sequence, slots past each length or before each
    sliding window), so a kernel that reads one produces NaN instead of a plausible number."""
    block_size = k_cache.shape[1]
    readable = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b, length in enumerate(seq_lens.tolist()):
        for t in range(max(0, length - window) if window else 0, length):
            readable[int(block_tables[b, t // block_size]), t % block_size] = True
    k_cache[~readable] = float("nan")
    v_cache[~readable] = float("nan")


# (num_q_heads, num_kv_heads, head_dim, block_size): MHA, GQA 4 and 3 (non-power-of-two), 3 again with the
# engine's shape, MQA 32; block sizes 8/16/32; head dims 64 (the kernel's specialised copy) and 96 (Phi-3),
# 128, 256 (Gemma) (its generic copy).
C_KERNEL_CASES = [
    (8, 8, 64, 16), (8, 2, 128, 8), (9, 3, 64, 16), (32, 1, 64, 32), (12, 4, 128, 32), (6, 3, 256, 8),
    (8, 2, 96, 16),
]


@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, block_size", C_KERNEL_CASES)
def test_c_kernel_matches_float64(c_kernel, num_q_heads, num_kv_heads, head_dim, block_size):
    max_blocks = 6
    g = generator(case_seed("c-len", num_q_heads, head_dim, block_size))
    lengths = [1, block_size, block_size + 1, 0, max_blocks * block_size,
               int(torch.randint(2, max_blocks * block_size, (1,), generator=g)), 3 * block_size - 1]
    seed = case_seed("c-kernel", num_q_heads, num_kv_heads, head_dim, block_size)
    q, kc, vc, bt, sl, _, _ = make_case(seed, batch=len(lengths), num_q_heads=num_q_heads,
                                        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                                        lengths=lengths, max_blocks=max_blocks, dtype=torch.float32,
                                        num_blocks=sum(-(-n // block_size) for n in lengths) + 5)
    assert int(bt[3, 0]) == -1 and int(bt[0, 1]) == -1  # padding entries: reading one would fail
    poison_unread_slots(kc, vc, bt, sl)
    # q a slice of a fused QKV buffer (batch stride wider than the heads), out a view inside a wider buffer.
    qkv = randn((len(lengths), num_q_heads + 2 * num_kv_heads, head_dim), torch.float32, "cpu", seed + 7)
    qkv[:, :num_q_heads] = q * 2  # a peakier softmax, so the running max moves and rescales matter
    q = qkv[:, :num_q_heads]
    out_base = poison(torch.empty((len(lengths), num_q_heads, head_dim + 16)))
    out = out_base[:, :, 3:3 + head_dim]
    assert c_kernel(q, kc, vc, bt, sl, 0.7 * head_dim ** -0.5, out)
    assert_close(out, attention64(q, kc, vc, bt, sl, 0.7 * head_dim ** -0.5), torch.float32)
    assert torch.equal(out[3], torch.zeros_like(out[3])), "a length-0 row must be exactly zero"
    assert torch.isnan(out_base[:, :, :3]).all() and torch.isnan(out_base[:, :, 3 + head_dim:]).all(), \
        "wrote outside out"


@pytest.mark.parametrize("head_dim", [32, 80, 96])
def test_c_kernel_other_head_dims(c_kernel, head_dim):
    """Head dims outside the CUDA kernel's set run in the C kernel's generic copy, through the public op too."""
    num_blocks, block_size, hq, hkv = 9, 16, 6, 2
    kc = randn((num_blocks, block_size, hkv, head_dim), torch.float32, "cpu", head_dim)
    vc = randn((num_blocks, block_size, hkv, head_dim), torch.float32, "cpu", head_dim + 1)
    q = randn((3, hq, head_dim), torch.float32, "cpu", head_dim + 2)
    bt = torch.tensor([[4, 0, 7], [2, -1, -1], [8, 4, 1]], dtype=torch.int32)
    sl = torch.tensor([37, 5, 48], dtype=torch.int32)
    poison_unread_slots(kc, vc, bt, sl)
    out = poison(torch.empty_like(q))
    assert c_kernel(q, kc, vc, bt, sl, head_dim ** -0.5, out)
    assert_close(out, attention64(q, kc, vc, bt, sl, head_dim ** -0.5), torch.float32)
    assert_close(paged_decode_attention(q, kc, vc, bt, sl), attention64(q, kc, vc, bt, sl, head_dim ** -0.5),
                 torch.float32)


def test_cuda_head_dims_are_refused_by_name():
    """The CUDA kernels are instantiated for 64/96/128/256 only: another head_dim is refused before any
    launch (checked without a GPU: the check precedes the allocation)."""
    for head_dim in (80, 112):
        with pytest.raises(ValueError, match=r"head_dim must be one of \(64, 96, 128, 256\) on CUDA"):
            allocate_kv_cache(2, 16, 1, head_dim, torch.float16, "cuda")
    k, v, _, _ = allocate_kv_cache(2, 16, 1, 96, torch.float16, "cpu")
    assert k.shape == (2, 16, 1, 96)


def test_c_kernel_long_context_and_interleaved_cache(c_kernel):
    """Thousands of tokens with a peaky softmax (many rescales), K/V as views of one [N, 2, bs, H, D] pool."""
    lengths, block_size, heads, head_dim = [2000, 1, 777], 16, 2, 64
    q, kc, vc, bt, sl, _, _ = make_case(case_seed("c-long"), batch=3, num_q_heads=8, num_kv_heads=heads,
                                        head_dim=head_dim, block_size=block_size, lengths=lengths,
                                        dtype=torch.float32)
    pool = torch.stack([kc, vc], dim=1)                                                # [N, 2, bs, H, D]
    kc, vc = pool[:, 0], pool[:, 1]
    poison_unread_slots(kc, vc, bt, sl)
    q = q * 4
    out = poison(torch.empty_like(q))
    assert c_kernel(q, kc, vc, bt, sl, 0.3, out)
    assert_close(out, attention64(q, kc, vc, bt, sl, 0.3), torch.float32)


def rope64(x, cos, sin):
    """Neox RoPE in float64: x [T, H, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    x = x.double()
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.double()[:, None] + rotated * sin.double()[:, None]


# (num_q_heads, num_kv_heads, head_dim, block_size): the engine's GQA 3 at head_dim 64, MHA at 128, MQA.
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, block_size",
                         [(9, 3, 64, 16), (4, 4, 128, 8), (8, 1, 64, 32), (4, 2, 96, 16), (2, 1, 256, 8)])
@pytest.mark.parametrize("window", [None, 2, "block+2"])
def test_c_fused_rope_write_attention_matches_float64(c_kernel, num_q_heads, num_kv_heads, head_dim,
                                                      block_size, window):
    """The engine's one-call CPU layer attention (kl_rope_write_paged_attention): three prompt tokens of
    one sequence after a cached prefix (each sees the ones before it, written in the same call), a decode
    token of another, and a padding row (slot -1, length 0) that must neither write nor read. With a sliding
    window each row sees the last `window` tokens of its own length (the prompt rows' windows differ)."""
    window = block_size + 2 if window == "block+2" else window
    seed = case_seed("c-fused", num_q_heads, num_kv_heads, head_dim, block_size, window)
    hq, hkv, d = num_q_heads, num_kv_heads, head_dim
    num_blocks = 7
    kc = randn((num_blocks, block_size, hkv, d), torch.float32, "cpu", seed)
    vc = randn((num_blocks, block_size, hkv, d), torch.float32, "cpu", seed + 1)
    # Sequence 0 holds `cached` tokens in blocks [5, 2, ...] and adds three; sequence 1 is at `pos1`.
    cached, pos1 = block_size + 3, 2 * block_size + 1
    tables = torch.tensor([[5, 2, 6], [1, 3, 0], [0, 0, 0]], dtype=torch.int32)
    positions = [cached, cached + 1, cached + 2, pos1, 0]
    seq_rows = [0, 0, 0, 1, None]

    def slot(row, p):
        return int(tables[row, p // block_size]) * block_size + p % block_size

    slots = torch.tensor([slot(r, p) if r is not None else -1 for r, p in zip(seq_rows, positions)])
    lens = torch.tensor([p + 1 if r is not None else 0 for r, p in zip(seq_rows, positions)], dtype=torch.int32)
    # NaN in every slot no row may read, and in the slots this call writes (they must be overwritten first).
    # (a window of W - 1 over the cached lengths starts where the first new row's window of W starts)
    poison_unread_slots(kc, vc, tables[:2], torch.tensor([cached, pos1], dtype=torch.int32),
                        window - 1 if window else None)
    for s in slots[slots >= 0].tolist():
        kc.view(-1, hkv, d)[s] = float("nan")
        vc.view(-1, hkv, d)[s] = float("nan")
    # qkv: the projection's rows inside a wider buffer (row stride > (hq + 2 hkv) d)
    width = (hq + 2 * hkv) * d
    qkv = randn((len(positions), width + 24), torch.float32, "cpu", seed + 2)[:, 8:8 + width]
    angles = torch.tensor(positions, dtype=torch.float32)[:, None] * (
        10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d))[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q, k, v = qkv.view(len(positions), -1, d).split([hq, hkv, hkv], dim=1)
    q64, k64 = rope64(q, cos, sin), rope64(k, cos, sin)
    expected_k, expected_v = kc.double().clone(), vc.double().clone()
    for row, s in enumerate(slots.tolist()):
        if s >= 0:
            expected_k.view(-1, hkv, d)[s], expected_v.view(-1, hkv, d)[s] = k64[row], v[row].double()
    before_k, before_v = kc.clone(), vc.clone()
    out = poison(torch.empty(len(positions), hq * d))
    row_tables = tables[[0, 0, 0, 1, 2]]  # a query row's own table: the rows of one sequence share it
    cpu_kernels.rope_write_paged_attention_cpu(qkv, cos, sin, slots, kc, vc, row_tables, lens, hq, 0.3, out,
                                               window=window or 0)

    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    written = written.view(num_blocks, block_size)
    assert torch.equal(vc[written].double(), expected_v[written]), "V must be stored exactly"
    assert_close(kc[written], expected_k[written], torch.float32)
    assert torch.equal(kc[~written].nan_to_num(7.0), before_k[~written].nan_to_num(7.0)), "wrote K elsewhere"
    assert torch.equal(vc[~written].nan_to_num(7.0), before_v[~written].nan_to_num(7.0)), "wrote V elsewhere"
    reference = attention64(q64, expected_k, expected_v, row_tables, lens, 0.3, window=window)
    assert_close(out.view(-1, hq, d), reference, torch.float32)
    assert torch.equal(out[4], torch.zeros_like(out[4])), "the padding row must be exactly zero"


# --------------------------------------------------------------------------------------------- sliding window
def windowed_case(seed, window, block_size, dtype):
    """Lengths around the window and the page edges (0, 1, W - 1, W, W + 1, several pages past it), the
    slots before each window poisoned and the table entries of pages wholly before it set to -1 (a kernel
    that reads them fails), and the expected output in float64."""
    lengths = sorted({1, max(window - 1, 1), window, window + 1, 2 * block_size + 1, 5 * block_size - 3,
                      6 * block_size}) + [0]
    q, kc, vc, bt, sl, _, _ = make_case(seed, batch=len(lengths), num_q_heads=6, num_kv_heads=2, head_dim=64,
                                        block_size=block_size, lengths=lengths, max_blocks=max(
                                            6, -(-max(lengths) // block_size)), dtype=dtype, shared=False)
    expected = attention64(q, kc, vc, bt, sl, 0.2, window=window)
    poison_unread_slots(kc, vc, bt, sl, window)
    for b, length in enumerate(lengths):
        bt[b, :max(0, length - window) // block_size] = -1
    return q, kc, vc, bt, sl, expected


WINDOWS = [1, 5, 16, 19, 40]  # with block_size 16: inside a page, a page exactly, across a page edge, 2.5 pages


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("path", ["c", "reference fp32", "reference bf16"])
def test_sliding_window_matches_float64(window, path, monkeypatch):
    dtype = torch.bfloat16 if path.endswith("bf16") else torch.float32
    q, kc, vc, bt, sl, expected = windowed_case(case_seed("window", window, path), window, 16, dtype)
    assert int(bt[-2, 0]) == -1, "the longest sequence must have pages wholly before its window"
    out = poison(torch.empty_like(q))
    if path == "c":
        monkeypatch.delenv("KERNEL_LAB_CPU_KERNELS", raising=False)
        if cpu_kernels.load_library() is None:
            pytest.skip("no C compiler ($CC or cc on PATH) to build kernel_lab/csrc/cpu")

        def no_reference(*args, **kwargs):
            raise AssertionError("the CPU fp32 op ran the PyTorch reference, not the C kernel")

        monkeypatch.setattr(paged_attention, "paged_decode_attention_reference", no_reference)
        paged_decode_attention(q, kc, vc, bt, sl, scale=0.2, out=out, sliding_window=window)
    elif path == "reference fp32":
        out = paged_decode_attention_reference(q, kc, vc, bt, sl, 0.2, sliding_window=window)
    else:
        paged_decode_attention(q, kc, vc, bt, sl, scale=0.2, out=out, sliding_window=window)  # CPU bf16: reference
    assert_close(out, expected, dtype)
    assert torch.equal(out[-1], torch.zeros_like(out[-1])), "a length-0 row must be exactly zero"


@pytest.mark.parametrize("window", [0, None, 6 * 16, 10_000])
def test_window_of_the_context_or_more_is_full_attention(c_kernel, window):
    q, kc, vc, bt, sl, _, _ = make_case(case_seed("window-full", window), batch=3, num_q_heads=4, num_kv_heads=4,
                                        head_dim=64, block_size=16, lengths=[6 * 16, 37, 1], dtype=torch.float32)
    poison_unread_slots(kc, vc, bt, sl)
    full = attention64(q, kc, vc, bt, sl, 0.125)
    assert_close(paged_decode_attention(q, kc, vc, bt, sl, sliding_window=window), full, torch.float32)
    reference = paged_decode_attention_reference(q, kc, vc, bt, sl, sliding_window=window)
    assert_close(reference, full, torch.float32)


# --------------------------------------------------------------------------------------------- bytes moved
def touched_bytes(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, window):
    """An independent count of what a call must touch: the nbytes of each slice it reads or writes (q,
    the output, seq_lens, each attended page's K/V rows, its table entry and fp8 scales); and the same
    caches, table and scales with everything outside those slices poisoned."""
    block_size = k_cache.shape[1]
    total = 2 * q.nbytes + seq_lens.nbytes
    keep_k, keep_v = poison(k_cache.clone()), poison(v_cache.clone())
    keep_scales = [None if s is None else poison(s.clone()) for s in (k_scale, v_scale)]
    keep_table = torch.full_like(block_tables, 2**31 - 1)  # outside any pool: read, it fails validation
    for b, length in enumerate(seq_lens.tolist()):
        first = max(0, length - window) if window else 0
        for j in range(first // block_size, -(-length // block_size)):
            page, lo, hi = int(block_tables[b, j]), max(first - j * block_size, 0), min(length - j * block_size,
                                                                                     block_size)
            total += k_cache[page, lo:hi].nbytes + v_cache[page, lo:hi].nbytes + block_tables[b, j:j + 1].nbytes
            keep_k[page, lo:hi], keep_v[page, lo:hi] = k_cache[page, lo:hi], v_cache[page, lo:hi]
            keep_table[b, j] = block_tables[b, j]
            for keep, scale in zip(keep_scales, (k_scale, v_scale)):
                if scale is not None:
                    total += scale[page].nbytes
                    keep[page] = scale[page]
    return total, (keep_k, keep_v, keep_table, *keep_scales)


@pytest.mark.parametrize("dtype, cache_dtype, window", [
    (torch.float32, torch.float32, None), (torch.float16, torch.float16, 19), (torch.bfloat16, torch.float8_e4m3fn, None),
    (torch.float16, torch.float8_e4m3fn, 5),
])
def test_bytes_moved_is_what_a_call_touches(dtype, cache_dtype, window):
    lengths, block_size, hq, hkv, head_dim = [0, 1, 16, 17, 50, 96], 16, 6, 2, 64
    q, kc, vc, bt, sl, ks, vs = make_case(case_seed("bytes", dtype, cache_dtype, window), batch=len(lengths),
                                          num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, block_size=block_size,
                                          lengths=lengths, dtype=dtype, cache_dtype=cache_dtype, shared=False)
    expected, (kk, vk, bk, ksk, vsk) = touched_bytes(q, kc, vc, bt, sl, ks, vs, window)
    assert paged_attention.bytes_moved(lengths, hq, hkv, head_dim, block_size, dtype, cache_dtype,
                                       window) == expected
    # The count is what the op needs: with everything else poisoned it gives the same output, bit for bit.
    clean = paged_decode_attention(q, kc, vc, bt, sl, k_scale=ks, v_scale=vs, sliding_window=window)
    kept = paged_decode_attention(q, kk, vk, bk, sl, k_scale=ksk, v_scale=vsk, sliding_window=window)
    assert torch.equal(kept, clean) and bool(torch.isfinite(kept).all())


def test_bytes_moved_of_the_benchmark_shape():
    # batch 4 x 2048 tokens, GQA 32:4, head_dim 128, bf16: K/V rows + q and out + 128 table entries each + lens
    kv = 2 * 4 * 2048 * 4 * 128 * 2
    assert paged_attention.bytes_moved([2048] * 4, 32, 4, 128, 16, torch.bfloat16) == (
        kv + 2 * 4 * 32 * 128 * 2 + 4 * 128 * 4 + 4 * 4)
    fp8 = paged_attention.bytes_moved([2048] * 4, 32, 4, 128, 16, torch.bfloat16, torch.float8_e4m3fn)
    assert fp8 == kv // 2 + 2 * 4 * 32 * 128 * 2 + 4 * 128 * (4 + 2 * 4 * 4) + 4 * 4


def test_an_unknown_variant_is_refused_by_name():
    q, kc, vc, bt, sl, _, _ = make_case(4, batch=1, num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=8,
                                        lengths=[9], dtype=torch.float32)
    with pytest.raises(ValueError, match=r"variant must be one of \('direct', 'pipelined'\), got 'fast'"):
        paged_decode_attention(q, kc, vc, bt, sl, variant="fast")


def test_window_start_is_transformers_sliding_window_mask():
    """The off-by-one that matters: transformers' mask (kv_idx > q_idx - W on top of causal) for the query at
    position length - 1 is the same key set as ours, [window_starts, length)."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    for window in (1, 2, 7, 16):
        mask = masking_utils.sliding_window_overlay(window)
        lengths = torch.arange(1, 40, dtype=torch.int32)
        starts = paged_attention.window_starts(lengths, window)
        for length, start in zip(lengths.tolist(), starts.tolist()):
            seen = [kv for kv in range(length) if mask(0, 0, length - 1, kv)]
            assert seen == list(range(start, length)), (window, length)


def test_sliding_window_bad_values_and_table_checks():
    q, kc, vc, bt, sl, _, _ = make_case(3, batch=2, num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=8,
                                        lengths=[30, 5], dtype=torch.float32)
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="sliding_window must be None or an int >= 0"):
            paged_decode_attention(q, kc, vc, bt, sl, sliding_window=bad)
    bt[0, :2] = 999  # pages wholly before a window of 10 (positions 20..29): never read, so not checked
    check_table_values(bt, sl, kc.shape[0], kc.shape[1], sliding_window=10)
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = 999 is outside the pool"):
        check_table_values(bt, sl, kc.shape[0], kc.shape[1], sliding_window=15)
    with pytest.raises(ValueError, match="outside the pool"):
        paged_decode_attention(q, kc, vc, bt, sl)


def test_public_op_runs_the_c_kernel_for_fp32(c_kernel, monkeypatch):
    def no_reference(*args, **kwargs):
        raise AssertionError("the CPU fp32 op ran the PyTorch reference, not the C kernel")

    q, kc, vc, bt, sl, _, _ = make_case(case_seed("c-public"), batch=4, num_q_heads=9, num_kv_heads=3,
                                        head_dim=64, block_size=16, lengths=[40, 0, 16, 3], dtype=torch.float32)
    poison_unread_slots(kc, vc, bt, sl)
    monkeypatch.setattr(paged_attention, "paged_decode_attention_reference", no_reference)
    out = poison(torch.empty_like(q))
    assert paged_decode_attention(q, kc, vc, bt, sl, out=out).data_ptr() == out.data_ptr()
    assert_close(out, attention64(q, kc, vc, bt, sl, 0.125), torch.float32)
    assert_close(paged_decode_attention(q, kc, vc, bt, sl), attention64(q, kc, vc, bt, sl, 0.125), torch.float32)


@pytest.mark.parametrize("how", ["disabled", "unavailable", "fp16"])
def test_public_op_falls_back_to_the_reference(monkeypatch, how):
    calls = []
    reference = paged_attention.paged_decode_attention_reference

    def counted_reference(*args, **kwargs):
        calls.append(1)
        return reference(*args, **kwargs)

    monkeypatch.setattr(paged_attention, "paged_decode_attention_reference", counted_reference)
    if how == "disabled":
        monkeypatch.setenv("KERNEL_LAB_CPU_KERNELS", "0")
    elif how == "unavailable":
        monkeypatch.setattr(cpu_kernels, "load_library", lambda: None)
    dtype = torch.float16 if how == "fp16" else torch.float32
    q, kc, vc, bt, sl, _, _ = make_case(case_seed("c-fallback", how), batch=2, num_q_heads=4, num_kv_heads=2,
                                        head_dim=64, block_size=8, lengths=[19, 5], dtype=dtype)
    out = paged_decode_attention(q, kc, vc, bt, sl)
    assert calls == [1]
    assert_close(out, attention64(q, kc, vc, bt, sl, 0.125), dtype)


def test_no_compiler_warns_once_and_returns_none(monkeypatch, tmp_path):
    monkeypatch.delenv("KERNEL_LAB_CPU_KERNELS", raising=False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    cpu_kernels._load.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C compiler"):
            assert cpu_kernels.load_library() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu_kernels.load_library() is None  # the answer is cached: no second warning
    finally:
        cpu_kernels._load.cache_clear()  # later tests load the real library again


def test_failed_build_warns_and_returns_none(monkeypatch, tmp_path):
    if cpu_kernels.compiler() is None:
        pytest.skip("no C compiler ($CC or cc on PATH)")
    bad = tmp_path / "broken.c"
    bad.write_text("this is not C\n")
    monkeypatch.delenv("KERNEL_LAB_CPU_KERNELS", raising=False)
    monkeypatch.setenv("KERNEL_LAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels, "SOURCE", bad)
    cpu_kernels._load.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="failed"):
            assert cpu_kernels.load_library() is None
        assert not list((tmp_path / "cache" / "cpu").glob("*")), "a failed build left files behind"
    finally:
        cpu_kernels._load.cache_clear()


def test_c_kernel_is_vectorised(c_kernel):
    """The kernel relies on the `omp simd` loops becoming SIMD code: on an x86-64 machine with AVX2 its library
    must contain packed FMAs at 256 bits or wider (a build that silently fell back to scalar code would still
    pass the maths tests). `-march=native` picks the width: ymm on AVX2 machines, zmm or ymm on AVX-512 ones
    (GCC's tuning for some AVX-512 CPUs prefers 256-bit vectors), so both count."""
    import platform
    import shutil
    import subprocess

    flags = f" {cpu_kernels._cpu_flags()} "
    if platform.machine() not in ("x86_64", "AMD64") or " avx2 " not in flags:
        pytest.skip("the instruction check is written for x86-64 with AVX2")
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) not on PATH")
    path = cpu_kernels.build(cpu_kernels.compiler())
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True,
                             check=True).stdout
    widths = ("ymm", "zmm") if " avx512f " in flags else ("ymm",)
    packed_fmas = {w: len(re.findall(rf"\bvfn?m(?:add|sub)\w*ps\s+%?{w}", listing)) for w in widths}
    assert sum(packed_fmas.values()) >= 16, (
        f"packed FMAs in {path.name}: {packed_fmas}: the loops were not vectorised")


# --------------------------------------------------------------------------------------------- split plan
@pytest.mark.parametrize("batch, hq, hkv, max_blocks, bs, sms", [
    (1, 32, 32, 2048, 16, 132), (1, 64, 8, 512, 64, 132), (256, 32, 8, 128, 16, 132), (3, 8, 8, 1, 8, 132),
    (7, 28, 4, 33, 32, 108), (2, 71, 1, 100, 16, 132), (64, 32, 32, 128, 16, 132),
])
def test_split_plan_covers_every_block_and_fills_the_gpu(batch, hq, hkv, max_blocks, bs, sms):
    plan = plan_splits(batch, hq, hkv, max_blocks, bs, sms)
    group = hq // hkv
    assert plan.heads_per_group <= HEADS_PER_GROUP and plan.head_groups * plan.heads_per_group >= group
    assert (plan.head_groups - 1) * plan.heads_per_group < group, "an empty head group"
    assert plan.num_splits * plan.partition_blocks >= max_blocks
    assert (plan.num_splits - 1) * plan.partition_blocks < max_blocks, "an always-empty split"
    if plan.num_splits > 1:
        assert plan.partition_blocks * bs >= MIN_PARTITION_TOKENS
    ctas = batch * hkv * plan.head_groups
    if ctas < sms and max_blocks * bs >= 2 * MIN_PARTITION_TOKENS:
        assert plan.num_splits > 1, "a small batch over a long table must be split"
    if ctas >= 2 * sms:
        assert plan.num_splits == 1


# --------------------------------------------------------------------------------------------- CPU model
MODEL_CASES = [
    # (hq, hkv, head_dim, block_size, lengths, dtype, cache dtype, plan)
    (4, 4, 64, 8, [1, 8, 9, 40], torch.float16, None, None),
    (8, 2, 128, 16, [33, 1, 64], torch.bfloat16, None, SplitPlan(1, 4, 1, 4)),       # one block per split
    (7, 1, 64, 8, [50, 17], torch.float32, None, SplitPlan(1, 7, 2, 4)),             # odd group, 2-block splits
    (16, 1, 64, 16, [45, 2], torch.float16, None, SplitPlan(2, 8, 1, 3)),            # two head groups of 8
    (6, 2, 256, 32, [70, 32, 33], torch.float16, torch.float8_e4m3fn, SplitPlan(1, 3, 1, 3)),
    (8, 8, 64, 64, [130, 64, 65], torch.bfloat16, torch.float8_e4m3fn, None),
    (4, 2, 128, 8, [24, 0, 1], torch.float16, None, SplitPlan(1, 2, 2, 2)),         # a zero-length row
]


@pytest.mark.parametrize("hq, hkv, head_dim, block_size, lengths, dtype, cache_dtype, plan", MODEL_CASES)
def test_kernel_model_matches_reference(hq, hkv, head_dim, block_size, lengths, dtype, cache_dtype, plan):
    max_blocks = max(-(-n // block_size) for n in lengths)
    if plan is not None:
        max_blocks = plan.num_splits * plan.partition_blocks - (plan.partition_blocks - 1)
        assert max_blocks * block_size >= max(lengths)
    seed = case_seed("model", hq, hkv, head_dim, block_size, lengths, dtype, cache_dtype)
    q, kc, vc, bt, sl, ks, vs = make_case(seed, batch=len(lengths), num_q_heads=hq, num_kv_heads=hkv,
                                          head_dim=head_dim, block_size=block_size, lengths=lengths,
                                          max_blocks=max_blocks, dtype=dtype, cache_dtype=cache_dtype)
    q = q * 3  # make the running max change along the sequence, so the rescales matter
    modelled = kernel_model(q.float(), kc, vc, bt, sl, 0.2, ks, vs, plan=plan)
    reference = paged_decode_attention_reference(q.float(), kc, vc, bt, sl, 0.2, ks, vs)
    assert_close(modelled, attention64(q.float(), kc, vc, bt, sl, 0.2, ks, vs), torch.float32)
    assert_close(modelled, reference.double(), torch.float32)


@pytest.mark.parametrize("window", [1, 16, 19, 40])
def test_split_plan_and_kernel_model_under_a_window(window):
    """The plan covers the pages a window can touch, not the table (work bounded by W), and the model, which
    starts at the window's first page and offset, matches float64 with every slot before the windows NaN
    and the table entries before them -1."""
    plan = plan_splits(1, 8, 1, 4096, 16, 132, window)
    pages = -(-(window - 1) // 16) + 1
    assert plan.num_splits * plan.partition_blocks >= pages
    assert (plan.num_splits - 1) * plan.partition_blocks < pages, "an always-empty split"
    assert plan_splits(1, 8, 1, 4096, 16, 132, 10**6) == plan_splits(1, 8, 1, 4096, 16, 132)
    q, kc, vc, bt, sl, expected = windowed_case(case_seed("model-window", window), window, 16, torch.float32)
    forced = SplitPlan(1, 3, 1, -(-(window - 1) // 16) + 1)  # one page per split: every split boundary
    for plan in (None, forced):
        assert_close(kernel_model(q, kc, vc, bt, sl, 0.2, plan=plan, sliding_window=window), expected, torch.float32)


def test_kernel_model_uses_the_shape_plan_by_default():
    """With the default plan on a small batch the model really splits (and still matches)."""
    lengths = [600, 5]
    q, kc, vc, bt, sl, _, _ = make_case(21, batch=2, num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=64,
                                        lengths=lengths, max_blocks=16, dtype=torch.float32)
    assert plan_splits(2, 2, 1, 16, 64, 132).num_splits > 1
    assert_close(kernel_model(q, kc, vc, bt, sl), attention64(q, kc, vc, bt, sl, 0.125), torch.float32)


# --------------------------------------------------------------------------------------------- bad input
def _good(dtype=torch.float16):
    q, kc, vc, bt, sl, _, _ = make_case(1, batch=2, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                                        lengths=[20, 5], max_blocks=2, dtype=dtype, shared=False)
    return dict(q=q, k_cache=kc, v_cache=vc, block_tables=bt, seq_lens=sl)


def _with(**changes):
    args = _good()
    args.update(changes)
    return args


BAD_INPUTS = [
    (lambda a: _with(q=a["q"].int()), TypeError, "q must have dtype"),
    (lambda a: _with(q=a["q"].bfloat16()), TypeError, "k_cache must have q's dtype"),  # fp32 q: 16-bit pages run
    (lambda a: _with(v_cache=a["v_cache"].float()), TypeError, "v_cache must have dtype"),
    (lambda a: _with(q=a["q"][:, :3]), ValueError, "multiple of the cache's num_kv_heads"),
    (lambda a: _with(q=a["q"][..., :32]), ValueError, "q head_dim"),
    (lambda a: _with(q=a["q"][0]), ValueError, "q must be 3-D"),
    (lambda a: _with(q=torch.empty(2, 4, 128, dtype=torch.float16)[..., ::2]), ValueError, "q must be contiguous"),
    (lambda a: _with(k_cache=a["k_cache"][:, :12].contiguous(), v_cache=a["v_cache"][:, :12].contiguous()),
     ValueError, "block_size"),
    (lambda a: _with(v_cache=a["v_cache"][:-1]), ValueError, "v_cache must have k_cache's shape"),
    (lambda a: _with(k_cache=a["k_cache"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "dense"),
    (lambda a: _with(block_tables=a["block_tables"].long()), TypeError, "block_tables must have dtype"),
    (lambda a: _with(block_tables=a["block_tables"][:1]), ValueError, "block_tables must have shape"),
    (lambda a: _with(seq_lens=a["seq_lens"].long()), TypeError, "seq_lens must have dtype"),
    (lambda a: _with(seq_lens=a["seq_lens"][:1]), ValueError, "seq_lens must have shape"),
    (lambda a: {**_good(), "scale": -1.0}, ValueError, "scale must be"),
    (lambda a: {**_good(), "out": torch.empty(2, 4, 63, dtype=torch.float16)}, ValueError, "out must have shape"),
    (lambda a: {**_good(), "k_scale": torch.ones(40, 2)}, ValueError, "k_scale is only used"),
    (lambda a: _with(seq_lens=torch.tensor([33, 5], dtype=torch.int32)), ValueError, r"seq_lens\[0\] = 33"),
    (lambda a: _with(seq_lens=torch.tensor([3, -1], dtype=torch.int32)), ValueError, r"seq_lens\[1\] = -1"),
    (lambda a: _with(block_tables=torch.tensor([[0, 999], [1, -1]], dtype=torch.int32)), ValueError,
     r"block_tables\[0, 1\] = 999 is outside the pool"),
    (lambda a: _with(block_tables=torch.tensor([[0, 2], [-1, 3]], dtype=torch.int32)), ValueError,
     r"block_tables\[1, 0\] = -1"),
]


@pytest.mark.parametrize("make, error, pattern", BAD_INPUTS)
def test_bad_input_is_rejected_with_a_named_argument(make, error, pattern):
    with pytest.raises(error, match=pattern):
        paged_decode_attention(**make(_good()))


def test_fp8_cache_needs_scales():
    kc, vc, ks, vs = allocate_kv_cache(4, 16, 2, 64, torch.float8_e4m3fn, "cpu")
    args = dict(q=randn((1, 2, 64), torch.float16, "cpu", 1), k_cache=kc, v_cache=vc,
                block_tables=torch.zeros((1, 1), dtype=torch.int32), seq_lens=torch.ones(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="k_scale is required"):
        paged_decode_attention(**args)
    with pytest.raises(ValueError, match="v_scale must have shape"):
        paged_decode_attention(**args, k_scale=ks, v_scale=vs[:2])
    with pytest.raises(TypeError, match="k_scale must have dtype"):
        paged_decode_attention(**args, k_scale=ks.double(), v_scale=vs)


def test_engine_style_fp32_cpu_round_trip():
    """The engine's CPU path: fp32 cache from allocate_kv_cache, written with write_kv, then decoded."""
    kc, vc, ks, vs = allocate_kv_cache(6, 8, 2, 64, torch.float32, "cpu")
    assert ks is None and vs is None and kc.shape == (6, 8, 2, 64) and not kc.any()
    key = randn((11, 2, 64), torch.float32, "cpu", 1)
    value = randn((11, 2, 64), torch.float32, "cpu", 2)
    bt = torch.tensor([[4, 1]], dtype=torch.int32)
    slots = torch.tensor([4 * 8 + i for i in range(8)] + [1 * 8 + i for i in range(3)])
    write_kv(key, value, kc, vc, slots)
    q = randn((1, 4, 64), torch.float32, "cpu", 3)
    out = paged_decode_attention(q, kc, vc, bt, torch.tensor([11], dtype=torch.int32))
    expected = torch.softmax(torch.einsum("hgd,thd->hgt", q.view(2, 2, 64), key) / 8, -1)
    expected = torch.einsum("hgt,thd->hgd", expected, value).reshape(1, 4, 64)
    assert_close(out, expected.double(), torch.float32)


# --------------------------------------------------------------------------------------------- compile
@pytest.fixture(scope="module")
def compiled():
    from kernel_lab.ops.cuda_extension import compile_kernels

    return compile_kernels("paged_attention")


def test_kernel_sources_build_for_every_target_without_spills(compiled):
    assert set(compiled) == {80, 89, 90}
    for capability, report in compiled.items():
        # 2 variants x 3 cache kinds x 4 head dims x 4 head tiles, plus the split merge kernel
        assert report["functions"] == 97, (capability, report["functions"])
        assert report["spill_stores"] == 0 and report["spill_loads"] == 0, (capability, report["log"][-3000:])
        assert report["stack_frame"] == 0, (capability, "local memory stack frame")


def test_sass_reads_kv_with_wide_loads(compiled):
    for capability, report in compiled.items():
        loads = set(re.findall(r"LDG\.E[A-Z0-9.]*", report["sass"]))
        assert any(".128" in op for op in loads), (capability, loads)  # fp16/bf16 K/V rows
        assert any(".64" in op for op in loads), (capability, loads)   # fp8 K/V rows
        assert "BAR.SYNC" in report["sass"] or "BAR.SYNC.DEFER_BLOCKING" in report["sass"]


def sass_functions(sass: str) -> dict[str, str]:
    """cuobjdump's listing split into {mangled name: its SASS}."""
    return {part.split()[0]: part for part in re.split(r"Function : ", sass)[1:]}


def test_pipelined_variant_copies_fp8_pages_in_16_byte_cp_async_pieces(compiled):
    """Every fp8 instance of the pipelined variant moves K/V with LDGSTS.128 (cp.async, 16 fp8 values per
    copy) and has no 8-byte global loads left; the direct variant keeps its 8-byte LDG.64 rows."""
    for capability, report in compiled.items():
        functions = sass_functions(report["sass"])
        fp8 = {name: body for name, body in functions.items() if "paged_decode_kernel" in name and "ElemKindE3" in name}
        pipelined = {name: body for name, body in fp8.items() if "VariantE1" in name}
        direct = {name: body for name, body in fp8.items() if "VariantE0" in name}
        assert len(pipelined) == len(direct) == 16, (capability, len(pipelined), len(direct))
        for name, body in pipelined.items():
            assert re.search(r"LDGSTS\.E[A-Z.]*\.128", body), (capability, name)
            assert not re.search(r"LDG\.E\.64", body), (capability, name)
        for name, body in direct.items():
            assert "LDGSTS" not in body and re.search(r"LDG\.E\.64", body), (capability, name)


def test_python_model_and_cuda_kernel_share_their_geometry():
    from kernel_lab.ops import paged_attention as pa
    from kernel_lab.ops.cuda_extension import CSRC

    source = (CSRC / "paged_attention.cu").read_text()
    assert re.search(rf"kNumWarps = {pa.NUM_WARPS};", source)
    assert re.search(rf"kElemsPerLane = {pa.ELEMS_PER_LANE};", source)
    assert "kChunk = kHeadTile <= 2 ? 4 : 2;" in source
    assert [pa.kernel_tile(h) for h in (1, 2, 3, 4, 5, 8)] == [(1, 4), (2, 4), (4, 2), (4, 2), (8, 2), (8, 2)]
    assert f"p.heads_per_group <= {pa.HEADS_PER_GROUP}) return launch_tile" in source


# --------------------------------------------------------------------------------------------- build pre-flight
def test_build_pre_flight_lists_everything_a_bare_machine_lacks():
    from kernel_lab.ops.cuda_extension import missing_build_tools

    good = dict(capability=(9, 0), torch_cuda="13.0", ninja=True, nvcc="/usr/local/cuda/bin/nvcc",
                nvcc_release="13.0", nvcc_archs={75, 80, 89, 90, 100})
    assert missing_build_tools(**good) == []
    bare = missing_build_tools(**{**good, "torch_cuda": None, "ninja": False, "nvcc": None})
    assert len(bare) == 3 and "CPU-only" in bare[0] and "ninja" in bare[1] and "nvcc" in bare[2]
    (mismatch,) = missing_build_tools(**{**good, "nvcc_release": "12.4"})
    assert "CUDA 12.4" in mismatch and "CUDA 13.0" in mismatch and "CUDA_HOME" in mismatch
    (old_gpu,) = missing_build_tools(**{**good, "capability": (7, 0)})
    assert "sm_70" in old_gpu and "sm_75" in old_gpu


@pytest.mark.parametrize("preset, warns", [(None, False), ("9.0", False), ("8.0;8.6", True), ("6.0;7.0;9.0+PTX", True)])
def test_build_is_for_the_gpu_in_use_whatever_the_preset_arch_list(preset, warns):
    from kernel_lab.ops.cuda_extension import build_arch_list

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert build_arch_list((9, 0), preset) == "9.0"
    assert bool(caught) == warns and all("TORCH_CUDA_ARCH_LIST" in str(w.message) for w in caught)


def test_nvcc_facts_read_this_machines_nvcc():
    from kernel_lab.ops.cuda_extension import find_nvcc, nvcc_facts

    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    release, archs = nvcc_facts(nvcc)
    assert re.fullmatch(r"\d+\.\d+", release) and {80, 89, 90} <= archs, (release, archs)


# --------------------------------------------------------------------------------------------- GPU
GPU_CASES = [
    # (batch, hq, hkv, head_dim, block_size, max_len)
    (1, 32, 32, 128, 16, 32768), (4, 32, 8, 128, 16, 4000), (33, 28, 4, 128, 32, 700), (2, 8, 1, 256, 64, 5000),
    (64, 16, 2, 64, 8, 300), (3, 64, 4, 128, 16, 2050), (5, 71, 1, 64, 32, 900), (4, 32, 32, 96, 16, 3000),
]


@pytest.mark.gpu
@pytest.mark.cuda_extension
@pytest.mark.parametrize("variant", list(paged_attention.DECODE_VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch, hq, hkv, head_dim, block_size, max_len", GPU_CASES)
def test_gpu_kernel_matches_reference(batch, hq, hkv, head_dim, block_size, max_len, dtype, variant):
    g = generator(case_seed("gpu-len", batch, max_len))
    lengths = torch.randint(1, max_len + 1, (batch,), generator=g).tolist()
    lengths[0] = max_len
    if batch > 2:
        lengths[1], lengths[2] = 1, block_size + 1
    seed = case_seed("gpu", batch, hq, hkv, head_dim, block_size, max_len, dtype)
    q, kc, vc, bt, sl, _, _ = make_case(seed, batch=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                                        block_size=block_size, lengths=lengths, dtype=dtype, device="cuda")
    out = poison(torch.empty_like(q))
    paged_decode_attention(q, kc, vc, bt, sl, out=out, validate=True, variant=variant)
    reference = paged_decode_attention_reference(q, kc, vc, bt, sl)
    assert_close(out, reference.double(), dtype, scale=2.0)
    assert_float64_subsample(out, q, kc, vc, bt, sl, dtype)


@pytest.mark.gpu
@pytest.mark.cuda_extension
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", WINDOWS + [4096])
@pytest.mark.parametrize("variant", list(paged_attention.DECODE_VARIANTS))
def test_gpu_sliding_window_matches_float64(window, dtype, variant):
    """The CUDA kernel under a window: slots before each window NaN, pages wholly before it -1 in the table."""
    q, kc, vc, bt, sl, expected = windowed_case(case_seed("gpu-window", window, dtype), window, 16, dtype)
    out = poison(torch.empty_like(q)).cuda()
    paged_decode_attention(q.cuda(), kc.cuda(), vc.cuda(), bt.cuda(), sl.cuda(), scale=0.2, out=out,
                           sliding_window=window, variant=variant)
    assert_close(out.cpu(), expected, dtype, scale=2.0)
    assert not out[-1].any(), "a length-0 row must be zeros"


def assert_float64_subsample(out, q, k_cache, v_cache, block_tables, seq_lens, dtype, k_scale=None, v_scale=None):
    """The GPU result against the float64 formulation (`attention64`) on the longest sequence and two more:
    the fp32 reference above is the op's own, so it alone would not catch an error the two share."""
    lens = seq_lens.cpu()
    rows = sorted({int(lens.argmax()), 0, lens.numel() - 1})
    cpu = [t.cpu() for t in (q[rows], k_cache, v_cache, block_tables[rows], lens[rows])]
    scales = [None if s is None else s.cpu() for s in (k_scale, v_scale)]
    expected = attention64(*cpu, q.shape[-1] ** -0.5, *scales)
    assert_close(out[rows], expected, dtype, scale=2.0)


# A captured graph replays with new lengths in the same tensors: the block tables must already map the
# largest length each sequence reaches, as the engine's tables do (a sequence's table grows before its length).
GRAPH_CAPTURE_LENGTHS = [3000, 1, 17, 2048, 5, 999, 64, 0]
GRAPH_REPLAY_LENGTHS = [1, 3000, 2000, 17, 0, 5, 1000, 33]


def graph_case(device):
    largest = [max(a, b) for a, b in zip(GRAPH_CAPTURE_LENGTHS, GRAPH_REPLAY_LENGTHS)]
    q, kc, vc, bt, sl, _, _ = make_case(77, batch=8, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                                        lengths=largest, dtype=torch.bfloat16, device=device)
    sl.copy_(torch.tensor(GRAPH_CAPTURE_LENGTHS, dtype=torch.int32))
    return q, kc, vc, bt, sl


def test_graph_case_tables_cover_every_replayed_length():
    """The CUDA-graph case on CPU: both length sets pass the host-side table check (a table too short
    for a replayed length would make the GPU kernel read block -1), and the reference runs on both."""
    q, kc, vc, bt, sl = graph_case("cpu")
    for lengths in (GRAPH_CAPTURE_LENGTHS, GRAPH_REPLAY_LENGTHS):
        sl.copy_(torch.tensor(lengths, dtype=torch.int32))
        check_table_values(bt, sl, kc.shape[0], kc.shape[1])
        paged_decode_attention_reference(q, kc, vc, bt, sl)
    with pytest.raises(ValueError, match="does not fit the block table"):  # the check does catch a short table
        check_table_values(bt[:, :1], sl, kc.shape[0], kc.shape[1])


@pytest.mark.gpu
@pytest.mark.cuda_extension
def test_gpu_under_cuda_graph_with_changing_lengths():
    q, kc, vc, bt, sl = graph_case("cuda")
    out = torch.empty_like(q)
    paged_decode_attention(q, kc, vc, bt, sl, out=out)  # warm up (builds the extension)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, kc, vc, bt, sl, out=out)
    sl.copy_(torch.tensor(GRAPH_REPLAY_LENGTHS, dtype=torch.int32))
    check_table_values(bt, sl, kc.shape[0], kc.shape[1])
    q.copy_(randn(q.shape, q.dtype, "cuda", 78))
    poison(out)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, paged_decode_attention_reference(q, kc, vc, bt, sl).double(), torch.bfloat16, scale=2.0)
    assert_float64_subsample(out, q, kc, vc, bt, sl, torch.bfloat16)
    assert torch.equal(out[4].float(), torch.zeros_like(out[4].float()))


@pytest.mark.gpu
@pytest.mark.cuda_extension
def test_gpu_validate_refuses_graph_capture_and_catches_bad_tables():
    q, kc, vc, bt, sl, _, _ = make_case(5, batch=2, num_q_heads=8, num_kv_heads=8, head_dim=64, block_size=16,
                                        lengths=[40, 5], dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="outside the pool"):
        paged_decode_attention(q, kc, vc, bt.clone().fill_(10_000), sl, validate=True)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        with torch.cuda.graph(graph):
            paged_decode_attention(q, kc, vc, bt, sl, validate=True)
