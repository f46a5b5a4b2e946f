"""16-bit KV pages (float16, bfloat16) in the CPU C kernel, in every ISA path this CPU can run.

Each test runs the default `-march=native` build and the narrowed builds `-mno-avx512f` (AVX2 + F16C) and
`-mno-avx` (scalar), and checks each build reports the path it took, so all three paths are tested on any
x86-64 machine with AVX-512 (and the ones below it elsewhere). What is checked:

- the write (`kl_store_kv_row`, the fused call's K/V store) rounds to nearest even, bit for bit torch's own
  `.to(float16 / bfloat16)`, on ties, subnormals, overflow and random wide-range values;
- the accuracy contract: the output on 16-bit pages against float64 attention on the *unrounded* float32
  K and V stays within the per-element bound derived in `storage_error_bound` (plus float32's own
  tolerance), with outlier channels, a 4K context over 256 pages, odd lengths and head counts, GQA and MQA,
  and a head_dim that leaves a remainder for every vector width;
- the fused RoPE + write + attention call on 16-bit pages;
- batch invariance, bit for bit within a format;
- the public op runs the C kernel for float32 q over 16-bit pages, and write_kv (the path without the C
  kernels) rounds float32 rows into them as torch does.
"""

from __future__ import annotations

import math
import platform

import pytest
import torch

from kernel_lab.harness.testing import case_seed, generator, poison, randn
from kernel_lab.ops import cpu_kernels, paged_attention, paged_decode_attention

HALF_FORMATS = [torch.float16, torch.bfloat16]
# Unit roundoff of round-to-nearest (half an ulp of 1) and, for fp16, the absolute error of its subnormal
# range (half of its smallest step 2^-24); bfloat16 shares float32's exponent range.
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
SUBNORMAL_ERROR = {torch.float16: 2.0 ** -25, torch.bfloat16: 0.0}
FLOAT32_TOLERANCE = 1e-5  # the float32 kernel's own bound (harness TOLERANCES), relative to the output's max


def _expected_isa(flags: str) -> str:
    if " avx512f " in flags:
        return "avx512"
    if all(f" {f} " in flags for f in ("avx2", "fma", "f16c")):
        return "avx2"
    return "scalar"


# (flags after -march=native, how to drop the CPU flags the build turns off)
BUILDS = [((), lambda f: f), (("-mno-avx512f",), lambda f: f.replace(" avx512f ", " ")), (("-mno-avx",), None)]


@pytest.fixture(params=BUILDS, ids=["native", "no-avx512", "no-avx"], scope="module")
def build(request):
    """(library, the path it reports) for one ISA build; each must report the path its flags leave."""
    if cpu_kernels.compiler() is None:
        pytest.skip("no C compiler ($CC or cc on PATH) to build kernel_lab/csrc/cpu")
    extra_flags, narrowed = request.param
    if extra_flags and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the ISA variants are x86-64 builds")
    lib = cpu_kernels.load_library("paged_decode_attention", extra_flags)
    assert lib is not None, f"the {extra_flags} build failed"
    isa = lib.kl_paged_attention_isa().decode()
    expected = "scalar" if narrowed is None else _expected_isa(narrowed(f" {cpu_kernels._cpu_flags()} "))
    assert isa == expected, (extra_flags, isa)
    return lib, isa


def store_row(lib, dtype, values: torch.Tensor) -> torch.Tensor:
    src = values.float().contiguous()
    dst = torch.empty(src.numel(), dtype=dtype)
    lib.kl_store_kv_row(cpu_kernels.KV_FORMATS[dtype], src.data_ptr(), src.numel(), dst.data_ptr())
    return dst


def rounding_cases(dtype) -> torch.Tensor:
    """Exact ties (the even neighbour wins), neighbours of ties, the subnormal range and its edge, the top of
    the finite range and overflow, signed zeros and infinities, then random values over a wide range."""
    info = torch.finfo(dtype)
    grid = torch.tensor([1.0, 1.5, 2.0, 3.0, 1000.0, 0.1, info.tiny, info.tiny / 2, info.tiny * 0.75])
    ulp = info.eps  # the step just above 1.0
    ties = torch.cat([grid * (1 + ulp / 2), grid * (1 + 3 * ulp / 2), grid * (1 + ulp / 2) * (1 + 2 ** -20),
                      grid * (1 + ulp / 2) * (1 - 2 ** -20)])
    edges = [info.max, info.max * (1 + ulp / 4), info.max * (1 + ulp / 2), info.max * 2, 0.0, -0.0,
             math.inf, -math.inf, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -26, 1e-30, 1e-40]
    g = generator(case_seed("half-rounding", str(dtype)))
    wide = torch.randn(4099, generator=g) * torch.exp2(torch.randint(-30, 17, (4099,), generator=g).float())
    values = torch.cat([ties, torch.tensor(edges, dtype=torch.float32), wide]).float()
    return torch.cat([values, -values])


@pytest.mark.parametrize("dtype", HALF_FORMATS, ids=str)
def test_writes_round_to_nearest_even_as_torch_does(build, dtype):
    lib, _ = build
    values = rounding_cases(dtype)
    stored = store_row(lib, dtype, values)
    expected = values.to(dtype)
    assert torch.equal(stored.view(torch.int16), expected.view(torch.int16)), \
        (values[stored.view(torch.int16) != expected.view(torch.int16)][:8], dtype)
    nan = store_row(lib, dtype, torch.tensor([math.nan, -math.nan, 1.0]))
    assert bool(nan[:2].isnan().all()) and float(nan[2]) == 1.0


@pytest.mark.parametrize("dtype", HALF_FORMATS, ids=str)
def test_reads_widen_every_finite_value_exactly(build, dtype):
    """Every finite 16-bit pattern (subnormals included), read back through the kernel: a length-1 sequence's
    output is its one V row times a softmax weight of exactly 1, so it must equal torch's widening bit for
    bit (as values). head_dim 68 puts patterns in the vector lanes and in the scalar remainder of every path."""
    lib, _ = build
    head_dim, block_size = 68, 16
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    patterns = patterns[patterns.float().isfinite()]
    rows = -(-patterns.numel() // head_dim)
    values = torch.zeros(rows * head_dim, dtype=dtype)
    values[:patterns.numel()] = patterns
    v = torch.zeros(rows, block_size, 1, head_dim, dtype=dtype)
    v[:, 0, 0] = values.view(rows, head_dim)
    k = torch.zeros_like(v)
    q = randn((rows, 1, head_dim), torch.float32, "cpu", 5)
    tables = torch.arange(rows, dtype=torch.int32)[:, None]
    out = poison(torch.empty_like(q))
    assert cpu_kernels.paged_decode_attention_cpu(q, k, v, tables, torch.ones(rows, dtype=torch.int32), 0.125,
                                                  out, library=lib)
    assert torch.equal(out[:, 0], v[:, 0, 0].float())  # as values: -0 comes out as 0 + 1 * -0 = +0


# ------------------------------------------------------------------------------------------- the contract
def paged_case(seed, *, num_q_heads, num_kv_heads, head_dim, block_size, lengths, outliers=True):
    """float32 K/V pages in a shuffled pool (-1 padding past each sequence's pages), a fresh q, and the same
    pages rounded into each 16-bit format through the kernel's own write. Outlier channels: two K channels
    20x and one V channel 30x larger than the rest, as LLM activations have."""
    g = generator(seed)
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 3
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(lengths), max(needed)), -1, dtype=torch.int32)
    for b, n in enumerate(needed):
        tables[b, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k, v = randn(shape, torch.float32, "cpu", seed + 1), randn(shape, torch.float32, "cpu", seed + 2)
    if outliers:
        k[..., [1, head_dim - 3]] *= 20.0
        v[..., head_dim // 2] *= 30.0
    q = randn((len(lengths), num_q_heads, head_dim), torch.float32, "cpu", seed + 3)
    return q, k, v, tables, torch.tensor(lengths, dtype=torch.int32)


def to_pages(lib, k, v, dtype):
    return store_row(lib, dtype, k.flatten()).view(k.shape), store_row(lib, dtype, v.flatten()).view(v.shape)


def attention64_with_bound(q, k, v, tables, lens, scale, dtype):
    """float64 attention on the unrounded K, V, and `storage_error_bound` for each output element."""
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float64)
    bound = torch.zeros_like(out)
    for b, length in enumerate(lens.tolist()):
        t = torch.arange(length)
        pages = tables[b].long()[t // block_size]
        kb = k[pages, t % block_size].double().transpose(0, 1)           # [Hkv, L, D]
        vb = v[pages, t % block_size].double().transpose(0, 1)
        qb = q[b].double().view(num_kv_heads, group, head_dim)
        weights = torch.softmax(scale * qb @ kb.transpose(1, 2), dim=-1)  # [Hkv, G, L]
        out[b] = (weights @ vb).reshape(num_q_heads, head_dim)
        bound[b] = storage_error_bound(qb, kb, vb, weights, scale, dtype).reshape(num_q_heads, head_dim)
    return out, bound


def storage_error_bound(q, k, v, p, scale, dtype):
    """The most one output element can move when K and V are rounded to `dtype` (exact arithmetic after).

    Rounding to nearest gives stored k~ = k + e with |e| <= u|k| + a (u the unit roundoff, a the subnormal
    error), likewise v~. A score s_t = scale q.k_t then moves by at most
        D_t = scale * sum_d |q_d| (u |k_td| + a),   D = max_t D_t,
    so each softmax weight p~_t = p_t exp(ds_t) / sum_j p_j exp(ds_j) lies within a factor exp(+-2D) of p_t.
    With o = sum_t p_t v_t and o~ = sum_t p~_t v~_t:
        |o~_d - o_d| <= sum_t |p~_t - p_t| |v~_td| + sum_t p_t |v~_td - v_td|
                     <= (exp(2D) - 1) ((1 + u) A_d + a) + u A_d + a,    A_d = sum_t p_t |v_td|.
    q [Hkv, G, D], k/v [Hkv, L, D], p [Hkv, G, L] (float64) -> [Hkv, G, D]."""
    u, a = UNIT_ROUNDOFF[dtype], SUBNORMAL_ERROR[dtype]
    score_shift = scale * q.abs() @ (u * k.abs() + a).transpose(1, 2)     # [Hkv, G, L]
    worst = torch.expm1(2 * score_shift.amax(-1, keepdim=True))           # [Hkv, G, 1]
    mass = p @ v.abs()                                                    # A_d: [Hkv, G, D]
    return worst * ((1 + u) * mass + a) + u * mass + a


# (num_q_heads, num_kv_heads, head_dim, block_size, lengths): the engine's GQA 3 at head_dim 64 over a 4K
# context of 256+ pages with odd lengths; an odd query-head count over one KV head (MQA) at head_dim 96; MHA
# with 5 heads at head_dim 36 (a remainder after 16- and 8-lane vectors) and lengths around the page size.
CONTRACT_CASES = [
    (9, 3, 64, 16, [4093, 1, 17, 300]),
    (7, 1, 96, 32, [1001, 33, 64]),
    (5, 5, 36, 8, [123, 8, 9, 1]),
]


@pytest.mark.parametrize("dtype", HALF_FORMATS, ids=str)
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, block_size, lengths", CONTRACT_CASES)
def test_half_pages_stay_within_the_rounding_bound(build, dtype, num_q_heads, num_kv_heads, head_dim,
                                                   block_size, lengths):
    lib, isa = build
    seed = case_seed("half-contract", num_q_heads, num_kv_heads, head_dim, block_size)
    q, k, v, tables, lens = paged_case(seed, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                       head_dim=head_dim, block_size=block_size, lengths=lengths)
    scale = head_dim ** -0.5
    kh, vh = to_pages(lib, k, v, dtype)
    out = poison(torch.empty_like(q))
    assert cpu_kernels.paged_decode_attention_cpu(q, kh, vh, tables, lens, scale, out, library=lib)
    reference, bound = attention64_with_bound(q, k, v, tables, lens, scale, dtype)
    error = (out.double() - reference).abs()
    limit = bound + FLOAT32_TOLERANCE * max(float(reference.abs().max()), 1.0)
    worst = float((error / limit).max())
    assert bool(out.isfinite().all()) and worst <= 1.0, (isa, dtype, worst)


@pytest.mark.parametrize("dtype", HALF_FORMATS, ids=str)
def test_batch_invariance_is_bit_exact_within_a_format(build, dtype):
    """A sequence's output does not depend on the rest of its batch or its place in it."""
    lib, _ = build
    lengths = [700, 3, 129, 64, 1]
    q, k, v, tables, lens = paged_case(case_seed("half-batch", str(dtype)), num_q_heads=9, num_kv_heads=3,
                                       head_dim=64, block_size=16, lengths=lengths)
    kh, vh = to_pages(lib, k, v, dtype)
    together = torch.empty_like(q)
    assert cpu_kernels.paged_decode_attention_cpu(q, kh, vh, tables, lens, 0.125, together, library=lib)
    for b in range(len(lengths)):
        order = [b] + [i for i in range(len(lengths)) if i != b][: b % 3]
        alone = torch.empty_like(q[order])
        assert cpu_kernels.paged_decode_attention_cpu(q[order].contiguous(), kh, vh, tables[order].contiguous(),
                                                      lens[order].contiguous(), 0.125, alone, library=lib)
        assert torch.equal(alone[0], together[b]), b


@pytest.mark.parametrize("dtype", HALF_FORMATS, ids=str)
def test_fused_rope_write_attention_on_half_pages(build, dtype):
    """kl_rope_write_paged_attention into 16-bit pages: V stored as torch rounds it, K as the rounding of the
    rotated row (one ulp of slack: the rotation is float32), untouched slots unchanged, and the rows'
    attention over the pages as they now hold them within float32's tolerance."""
    lib, _ = build
    hq, hkv, d, block_size = 9, 3, 64, 16
    seed = case_seed("half-fused", str(dtype))
    q0, k, v, tables, _ = paged_case(seed, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=block_size,
                                     lengths=[40, 20])
    kh, vh = to_pages(lib, k, v, dtype)
    positions, rows = [37, 38, 39, 19], [0, 0, 0, 1]          # three prompt rows of sequence 0, one decode row
    slots = torch.tensor([int(tables[r, p // block_size]) * block_size + p % block_size
                          for r, p in zip(rows, positions)])
    lens = torch.tensor([p + 1 for p in positions], dtype=torch.int32)
    width = (hq + 2 * hkv) * d
    qkv = randn((4, width), torch.float32, "cpu", seed + 5)
    angles = torch.tensor(positions, dtype=torch.float32)[:, None] * (
        10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d))[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    before_k, before_v = kh.clone(), vh.clone()
    out = poison(torch.empty(4, hq * d))
    row_tables = tables[rows].contiguous()
    cpu_kernels.rope_write_paged_attention_cpu(qkv, cos, sin, slots, kh, vh, row_tables, lens, hq, 0.125, out,
                                               library=lib)
    q, kn, vn = qkv.view(4, -1, d).split([hq, hkv, hkv], dim=1)
    half = d // 2
    rope = lambda x: x.double() * cos.double()[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1).double() \
        * sin.double()[:, None]  # noqa: E731
    flat_k, flat_v = kh.view(-1, hkv, d), vh.view(-1, hkv, d)
    assert torch.equal(flat_v[slots].view(torch.int16), vn.to(dtype).view(torch.int16)), "V must round as torch"
    k_step = UNIT_ROUNDOFF[dtype] * 2 * rope(kn).abs() + 2.0 ** -24
    assert bool(((flat_k[slots].double() - rope(kn)).abs() <= k_step).all()), "K is not the rounded rotation"
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched].view(torch.int16), before_k.view(-1, hkv, d)[untouched].view(torch.int16))
    assert torch.equal(flat_v[untouched].view(torch.int16), before_v.view(-1, hkv, d)[untouched].view(torch.int16))
    reference = attention64_with_bound(rope(q).float(), kh.float(), vh.float(), row_tables, lens, 0.125, dtype)[0]
    error = float((out.view(4, hq, d).double() - reference).abs().max())
    assert error <= 2 * FLOAT32_TOLERANCE * max(float(reference.abs().max()), 1.0), error


@pytest.mark.parametrize("dtype", HALF_FORMATS, ids=str)
def test_public_op_runs_the_c_kernel_on_half_pages(dtype, monkeypatch):
    if cpu_kernels.compiler() is None:
        pytest.skip("no C compiler")
    q, k, v, tables, lens = paged_case(case_seed("half-op", str(dtype)), num_q_heads=4, num_kv_heads=2,
                                       head_dim=64, block_size=16, lengths=[50, 7])
    kh, vh = k.to(dtype), v.to(dtype)
    reference = paged_decode_attention(q, kh, vh, tables, lens)  # the C kernel
    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran")
    monkeypatch.setattr(paged_attention, "paged_decode_attention_reference", refuse)
    assert torch.equal(paged_decode_attention(q, kh, vh, tables, lens), reference)
    monkeypatch.undo()
    monkeypatch.setenv("KERNEL_LAB_CPU_KERNELS", "0")
    fallback = paged_decode_attention(q, kh, vh, tables, lens)
    assert fallback.dtype == torch.float32
    assert float((fallback - reference).abs().max()) <= 1e-5 * max(float(reference.abs().max()), 1.0)


@pytest.mark.parametrize("dtype", HALF_FORMATS, ids=str)
def test_write_kv_rounds_float32_rows_into_half_pages(dtype):
    """The engine's path without the C kernels: write_kv stores float32 rows into 16-bit CPU pages, rounded
    as torch rounds (nearest even), at the given slots only."""
    from kernel_lab.ops import allocate_kv_cache, write_kv

    k_cache, v_cache, _, _ = allocate_kv_cache(4, 16, 2, 8, dtype, "cpu")
    key, value = randn((5, 2, 8), torch.float32, "cpu", 11), randn((5, 2, 8), torch.float32, "cpu", 12)
    slots = torch.tensor([3, 17, 18, 40, 63])
    write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 8)[slots].view(torch.int16), key.to(dtype).view(torch.int16))
    assert torch.equal(v_cache.view(-1, 2, 8)[slots].view(torch.int16), value.to(dtype).view(torch.int16))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not bool(k_cache.view(-1, 2, 8)[untouched].any())
