"""int8 pages (one float32 scale per token, KV head and 16 channels) and fp8 E4M3 pages (one float32 scale per
page and KV head, project 05's policy) in the CPU C kernels, in every ISA path this CPU can run (the native build,
`-mno-avx512f` and `-mno-avx`, each checked to report its path). Every test of the read, the contract, batch
invariance and the fused call runs on both formats.

int8, as kernel_lab/ops/kv_cache.py states it (issue 35): each token's row of each KV head is written once,
each group of 16 channels with its own scale s = amax / 127 over the group's finite elements, and never
requantised, so every stored
element satisfies |x - code * s| <= s / 2, up to float32's rounding of x / s and code * s (together under
s * 2^-16: `element_bound`), whatever was written before or after.
For attention that means (exact arithmetic after the rounding, e the realised K/V errors): a score moves by
at most D_t = scale * sum_d |q_d| |e^k_td|, each softmax weight by a factor within exp(+-2 max_t D_t), so
|o~_d - o_d| <= (exp(2D) - 1) sum_t p_t (|v_td| + |e^v_td|) + sum_t p_t |e^v_td| (`output_error_bound`).
With an outlier channel a group's scale follows the outlier, so the group's other channels lose precision:
the per-element bound is in units of the group's scale, not of the element (after the rotation is undone, of
the mean scale of the element's Hadamard block: `slot_scales`).

fp8 (E4M3, code max 448, a power-of-two scale per page that grows with requantisation): the first rounding
errs by at most 2^-4 |x| (3 mantissa bits) or, below 2^-6 in code units, half the 2^-9 step; a requantisation
by a power of two is exact unless the code turns subnormal, then errs by half a step at the new scale, and
the scales at least double: so |x - stored| <= 2^-4 |x| + 2^-9 s at the page's final scale s if written there
(project 05's bound), <= 2^-4 |x| + 2^-8 s in any order.
What is checked:

- the fused call's write (kl_write_kv_scaled) is kv_cache.write_kv_reference called once per token, byte for
  byte, scales too, with NaN and inf (fp8: with page growth); the stored errors meet the per-element bound,
  and an int8 write leaves every other token's codes and scales as they were;
- the read: the fp8 kernel equals the bfloat16 kernel over the dequantised pages bit for bit (the codes and
  power-of-two scales are exact in bfloat16), the int8 kernel the float32 kernel over them to float32's
  tolerance (its scales are not powers of two), NaN codes included;
- against float64 attention on the unquantised K/V, with outlier channels, a 4K context, odd head counts
  and page sizes: the output within `output_error_bound` (plus float32's tolerance);
- batch invariance, bit for bit; the fused RoPE + write + attention call gives the same pages and outputs
  however a prompt's rows are split into calls; the public op runs the C kernel on int8 pages.
"""

from __future__ import annotations

import math
import platform

import pytest
import torch

from kernel_lab.harness.testing import assert_close, case_seed, generator, poison, randn
from kernel_lab.ops import allocate_kv_cache, cpu_kernels, paged_attention, paged_decode_attention, write_kv
from kernel_lab.ops.kv_cache import (
    FP8_DTYPE,
    INT8_NAN,
    dequantize_pages,
    element_scales,
    expand_int8_scales,
    hadamard_block,
    hadamard_rotate,
    int8_rows,
    write_kv_reference,
)

FLOAT32_TOLERANCE = 1e-5  # the float32 kernel's own bound (harness TOLERANCES), relative to the output's max


def _expected_isa(flags: str) -> str:
    if " avx512f " in flags:
        return "avx512"
    if all(f" {f} " in flags for f in ("avx2", "fma", "f16c")):
        return "avx2"
    return "scalar"


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


@pytest.fixture(params=[torch.int8, FP8_DTYPE], ids=["int8", "fp8"])
def page_dtype(request):
    return request.param


def store_nan(cache, index):
    """A NaN into one element of int8 (its code -128) or fp8 (E4M3's NaN) pages."""
    cache[index] = INT8_NAN if cache.dtype == torch.int8 else math.nan


def element_bound(dtype, x, s, *, at_final_scale=False, rotated=False):
    """The most |x - stored| may be for an element x of scale s (int8: its row's; fp8: its page's final one;
    module docstring). `rotated`: an int8 element after the rotation is undone, where the float32
    butterflies there and back add a few ulps of s."""
    if dtype == torch.int8:
        return s * (0.5 + (2.0 ** -11 if rotated else 2.0 ** -16))
    return 2.0 ** -4 * x.abs() + s * (2.0 ** -9 if at_final_scale else 2.0 ** -8)


# ------------------------------------------------------------------------------------------- cases
def sequences_case(seed, *, num_q_heads, num_kv_heads, head_dim, block_size, lengths, outliers=True):
    """Sequences in a shuffled pool (-1 padding past each one's pages) and the float32 K/V of each token,
    which decode appends one at a time: `tokens` is every sequence's K/V in position order, `slots` where each
    goes. Outlier channels (two K channels 20x, one V channel 30x, as LLM activations have) and every 7th
    token 4x larger, so fp8 pages grow after their first tokens and are requantised."""
    g = generator(seed)
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 3
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(lengths), max(needed)), -1, dtype=torch.int32)
    for b, n in enumerate(needed):
        tables[b, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
    total = sum(lengths)
    k = randn((total, num_kv_heads, head_dim), torch.float32, "cpu", seed + 1)
    v = randn((total, num_kv_heads, head_dim), torch.float32, "cpu", seed + 2)
    if outliers:
        k[..., [1, head_dim - 3]] *= 20.0
        v[..., head_dim // 2] *= 30.0
    k[::7] *= 4.0
    v[3::7] *= 4.0
    slots = torch.cat([(tables[b].long()[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size)
                       for b, n in enumerate(lengths)])
    q = randn((len(lengths), num_q_heads, head_dim), torch.float32, "cpu", seed + 3)
    return q, k, v, slots, tables, torch.tensor(lengths, dtype=torch.int32), num_blocks


def float_pool(rows, slots, num_blocks, block_size):
    """The unquantised rows at their slots of a float32 pool [num_blocks, block_size, H, D] (zeros elsewhere)."""
    pool = torch.zeros((num_blocks * block_size, *rows.shape[1:]))
    pool[slots] = rows
    return pool.view(num_blocks, block_size, *rows.shape[1:])


def scaled_pages(lib, k, v, slots, num_blocks, block_size, dtype=torch.int8):
    """The rows written by the C kernels' int8 or fp8 write (kl_write_kv_scaled), one token after another."""
    kc, vc, ks, vs = allocate_kv_cache(num_blocks, block_size, k.shape[1], k.shape[2], dtype)
    cpu_kernels.write_kv_scaled_cpu(k, v, kc, vc, slots, ks, vs, library=lib)
    return kc, vc, ks, vs


def values(cache, scale):
    return dequantize_pages(cache, element_scales(scale, cache.dtype, cache.shape[-1]))


def page_rows(cache, scale):
    """The K or V rows pages hold: their values, with int8's Hadamard rotation undone."""
    stored = values(cache, scale)
    return int8_rows(stored) if cache.dtype == torch.int8 else stored


def slot_scales(scale, slots, dtype, block_size, head_dim, *, rotated=False):
    """The scale of each element of the written slots' rows, [slots, num_kv_heads, head_dim]: its group's own
    (int8) or its page's (fp8). `rotated`: int8 elements after the rotation is undone, where each is a 1 / block
    combination of its Hadamard block's stored elements, so it errs by at most the block's mean scale / 2."""
    if dtype != torch.int8:
        return scale[slots // block_size][..., None].expand(-1, -1, head_dim)
    per_element = expand_int8_scales(scale.flatten(0, 1)[slots], head_dim)
    if not rotated:
        return per_element
    block = hadamard_block(head_dim)
    blocks = per_element.unflatten(-1, (head_dim // block, block))
    return blocks.mean(-1, keepdim=True).expand(blocks.shape).flatten(-2)


def sylvester(n):
    """Sylvester's Hadamard matrix of order n (a power of two), built by its definition, float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("head_dim, block", [(64, 64), (96, 32), (40, 8), (36, 4), (128, 128), (7, 1)])
def test_hadamard_rotation_is_sylvesters_matrix_block_by_block(head_dim, block):
    """hadamard_rotate against the explicit block-diagonal matrix in float64 on random rows, and int8_rows
    inverts it: the identity (H q / block) . (H k) = q . k the read relies on."""
    assert hadamard_block(head_dim) == block
    g = generator(case_seed("hadamard", head_dim))
    x = torch.randn(5, 3, head_dim, generator=g, dtype=torch.float64) * 3
    explicit = torch.block_diag(*[sylvester(block)] * (head_dim // block))
    assert_close(hadamard_rotate(x), x @ explicit.T, torch.float32)
    assert_close(int8_rows(hadamard_rotate(x)), x, torch.float32)
    q = torch.randn(5, 3, head_dim, generator=g, dtype=torch.float64)
    assert_close((hadamard_rotate(q) * hadamard_rotate(x)).sum(-1) / block, (q * x).sum(-1), torch.float32)


# ------------------------------------------------------------------------------------------- the write
def test_int8_write_is_the_reference_per_token_and_meets_the_element_bound(build):
    """kl_write_kv_scaled against kv_cache.write_kv_reference called once per token, bytes and scales, over
    rows of ranges 2^-6 to 2^8 with NaN and +-inf in some; then the per-element bound in units of each row's
    own scale, NaN stored as NaN and inf as the range's end; and a write leaves every other slot's codes and
    scales as they were (nothing is requantised)."""
    lib, isa = build
    hkv, d, block_size, num_blocks = 3, 40, 8, 6
    g = generator(case_seed("int8-write", isa))
    tokens = 37
    k = torch.randn(tokens, hkv, d, generator=g) * torch.exp2(torch.randint(-6, 8, (tokens, 1, 1), generator=g).float())
    v = torch.randn(tokens, hkv, d, generator=g) * torch.exp2(torch.randint(-6, 8, (tokens, 1, 1), generator=g).float())
    k[4, 1, 5], k[9, 0, 0], v[11, 2, 7], v[20, 1, 1] = math.nan, math.inf, -math.inf, math.nan
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[[3, 30]] = -1
    kc, vc, ks, vs = scaled_pages(lib, k, v, slots, num_blocks, block_size)
    rc, rv, rks, rvs = allocate_kv_cache(num_blocks, block_size, hkv, d, torch.int8)
    for t in range(tokens):
        before = [c.clone() for c in (rc, rv, rks, rvs)]
        write_kv_reference(k[t:t + 1], v[t:t + 1], rc, rv, slots[t:t + 1], rks, rvs)
        others = torch.ones(num_blocks * block_size, dtype=torch.bool)
        others[slots[t].clamp_min(0)] = slots[t] < 0
        for old, new in zip(before, (rc, rv, rks, rvs)):
            assert torch.equal(old.flatten(0, 1)[others], new.flatten(0, 1)[others]), t
    for name, ours, theirs in (("k_cache", kc, rc), ("v_cache", vc, rv), ("k_scale", ks, rks), ("v_scale", vs, rvs)):
        assert torch.equal(ours, theirs), (isa, name)
    valid = slots >= 0
    for which, written, cache, scale in ((0, hadamard_rotate(k), kc, ks), (1, hadamard_rotate(v), vc, vs)):  # rotated
        stored = values(cache, scale).view(-1, hkv, d)[slots[valid]]
        x, s = written[valid], slot_scales(scale, slots[valid], torch.int8, block_size, d)
        finite = x.isfinite()
        error = (stored - x).abs()
        assert bool((error[finite] <= element_bound(torch.int8, x, s)[finite]).all()), (
            isa, which, float((error[finite] / s[finite]).max()))
        assert bool(stored[x.isnan()].isnan().all())
        inf = x.isinf()
        assert torch.equal(stored[inf], torch.copysign(127 * s[inf], x[inf]))


def test_public_write_kv_takes_int8_pages_as_the_reference_does():
    """write_kv on CPU int8 pages (the engine's path without the C kernels) is the reference, and touches the
    written slots only (the rest keep their stale bytes: nothing reads a slot before it is written)."""
    kc, vc, ks, vs = allocate_kv_cache(4, 16, 2, 8, torch.int8, "cpu")
    kc.fill_(INT8_NAN)
    key, value = randn((5, 2, 8), torch.float32, "cpu", 11), randn((5, 2, 8), torch.float32, "cpu", 12)
    slots = torch.tensor([3, 17, 18, 40, 63])
    rc, rv, rks, rvs = kc.clone(), vc.clone(), ks.clone(), vs.clone()
    write_kv(key, value, kc, vc, slots, ks, vs)
    write_kv_reference(key, value, rc, rv, slots, rks, rvs)
    assert torch.equal(kc, rc) and torch.equal(vc, rv) and torch.equal(ks, rks) and torch.equal(vs, rvs)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert bool((kc.view(-1, 2, 8)[untouched] == INT8_NAN).all()) and not bool(ks.view(-1, 2)[untouched].any())
    with pytest.raises(ValueError, match="k_scale is required with a torch.int8 cache"):
        write_kv(key, value, kc, vc, slots)


def test_fp8_write_is_the_policy_reference_per_token_and_meets_the_element_bound(build):
    """As the int8 test above, on fp8 pages: bytes (NaN of either sign, -0, codes that turn subnormal when
    requantised) and scales equal the reference called once per token, then fp8's per-element bound."""
    lib, isa = build
    hkv, d, block_size, num_blocks, tokens = 3, 40, 8, 6, 37
    g = generator(case_seed("fp8-write", isa))
    k, v = (torch.randn(tokens, hkv, d, generator=g)
            * torch.exp2(torch.randint(-12, 8, (tokens, 1, 1), generator=g).float()) for _ in range(2))
    k[4, 1, 5], k[9, 0, 0], v[11, 2, 7], v[20, 1, 1], k[6, 2, 3] = math.nan, math.inf, -math.inf, -math.nan, -0.0
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[[3, 30]] = -1
    kc, vc, ks, vs = scaled_pages(lib, k, v, slots, num_blocks, block_size, FP8_DTYPE)
    rc, rv, rks, rvs = allocate_kv_cache(num_blocks, block_size, hkv, d, FP8_DTYPE)
    write_scale = torch.zeros(tokens, 2, hkv)
    for t in range(tokens):
        write_kv_reference(k[t:t + 1], v[t:t + 1], rc, rv, slots[t:t + 1], rks, rvs)
        if slots[t] >= 0:
            write_scale[t, 0], write_scale[t, 1] = rks[slots[t] // block_size], rvs[slots[t] // block_size]
    for name, ours, theirs in (("k_cache", kc, rc), ("v_cache", vc, rv), ("k_scale", ks, rks), ("v_scale", vs, rvs)):
        assert torch.equal(_bits(ours), _bits(theirs)), (isa, name)
    valid = slots >= 0
    for which, written, cache, scale in ((0, k, kc, ks), (1, v, vc, vs)):
        stored = values(cache, scale).view(-1, hkv, d)[slots[valid]]
        x, s = written[valid], scale[slots[valid] // block_size][:, :, None].expand(-1, -1, d)
        finite = x.isfinite()
        error = (stored - x).abs()
        assert bool((error[finite] <= element_bound(FP8_DTYPE, x, s)[finite]).all()), (isa, which)
        kept = (write_scale[valid, which][:, :, None] == s) & finite
        assert bool(kept.any()) and bool((~kept & finite).any()), "the case must grow some pages after a write"
        tight = element_bound(FP8_DTYPE, x, s, at_final_scale=True)
        assert bool((error[kept] <= tight[kept]).all()), (isa, which)
        assert bool(stored[x.isnan()].isnan().all())


def test_every_fp8_code_reads_as_torch_widens_it(build):
    """All 256 E4M3 bytes (subnormals, both zeros, both NaNs) as V rows of one-token sequences, scale 1:
    each output row is its V row (weight 1), so the kernel's widening (vector and remainder lanes) is
    checked against torch's, value for value."""
    lib, isa = build
    d = 19  # a vector and a remainder on every path
    codes = torch.arange(266, dtype=torch.int64).remainder(256).to(torch.uint8)
    rows = codes.numel() // d
    vc = codes[: rows * d].view(FP8_DTYPE).view(rows, 1, 1, d).contiguous()
    kc = torch.zeros_like(vc.view(torch.uint8)).view(FP8_DTYPE)
    ones = torch.ones(rows, 1)
    tables = torch.arange(rows, dtype=torch.int32)[:, None]
    q = randn((rows, 1, d), torch.float32, "cpu", 5)
    out = poison(torch.empty_like(q))
    assert cpu_kernels.paged_decode_attention_cpu(q, kc, vc, tables, torch.ones(rows, dtype=torch.int32), 0.5, out,
                                                  library=lib, k_scale=ones, v_scale=ones)
    expected = vc.float().view(rows, 1, d)
    assert torch.equal(out.isnan(), expected.isnan()), isa
    assert torch.equal(out.nan_to_num(), expected.nan_to_num()), isa


# ------------------------------------------------------------------------------------------- the read
def test_the_read_applies_each_scale_where_it_belongs(build, page_dtype):
    """The fp8 kernel over codes and power-of-two page scales equals the bfloat16 kernel over code * scale
    (exact in bfloat16), bit for bit; the int8 kernel over codes and per-token scales equals the float32 kernel
    over code * scale to float32's tolerance (a scale goes on each score and probability instead of on each
    element). So scales are applied to the right page (token) and head, and to nothing else. One KV head holds
    a NaN code: its query heads' outputs are NaN, the other heads' stay finite."""
    lib, isa = build
    q, k, v, slots, tables, lens, num_blocks = sequences_case(
        case_seed("int8-exact", isa), num_q_heads=6, num_kv_heads=3, head_dim=36, block_size=16,
        lengths=[200, 5, 33])
    kc, vc, ks, vs = scaled_pages(lib, k, v, slots, num_blocks, 16, page_dtype)
    store_nan(kc.view(-1, 3, 36), (slots[230], 1, 7))  # sequence 2's 25th token, KV head 1
    out = poison(torch.empty_like(q))
    assert cpu_kernels.paged_decode_attention_cpu(q, kc, vc, tables, lens, 0.2, out, library=lib, k_scale=ks,
                                                  v_scale=vs)
    wide = torch.float32 if page_dtype == torch.int8 else torch.bfloat16
    kb, vb = page_rows(kc, ks).to(wide), page_rows(vc, vs).to(wide)
    assert torch.equal(kb.float().nan_to_num(), page_rows(kc, ks).nan_to_num())  # fp8: exact in bfloat16
    expected = poison(torch.empty_like(q))
    assert cpu_kernels.paged_decode_attention_cpu(q, kb, vb, tables, lens, 0.2, expected, library=lib)
    assert bool(out[2, 2:4].isnan().all()) and bool(out[:2].isfinite().all()) and bool(out[2, [0, 1, 4, 5]].isfinite().all())
    if page_dtype == torch.int8:
        assert torch.equal(out.isnan(), expected.isnan())
        assert_close(out.nan_to_num(), expected.nan_to_num(), torch.float32)
    else:
        assert torch.equal(out.nan_to_num(), expected.nan_to_num()), (isa, float((out - expected).abs().nan_to_num().max()))


# ------------------------------------------------------------------------------------------- the contract
def output_error_bound(q, k, v, ek, ev, p, scale):
    """The most one output element can move under K/V errors |ek|, |ev| (module docstring). q [Hkv, G, D],
    k/v/ek/ev [Hkv, L, D], p [Hkv, G, L] (float64) -> [Hkv, G, D]."""
    shift = scale * q.abs() @ ek.transpose(1, 2)                            # [Hkv, G, L]
    worst = torch.expm1(2 * shift.amax(-1, keepdim=True))
    return worst * (p @ (v.abs() + ev)) + p @ ev


def attention64_with_bound(q, k, v, kq, vq, tables, lens, scale):
    """float64 attention on the unquantised K, V (pools), and output_error_bound from the stored errors."""
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float64)
    bound = torch.zeros_like(out)
    for b, length in enumerate(lens.tolist()):
        t = torch.arange(length)
        pages = tables[b].long()[t // block_size]
        kb, vb = (x[pages, t % block_size].double().transpose(0, 1) for x in (k, v))       # [Hkv, L, D]
        ek, ev = ((x[pages, t % block_size].double().transpose(0, 1) - y).abs() for x, y in ((kq, kb), (vq, vb)))
        qb = q[b].double().view(num_kv_heads, group, head_dim)
        weights = torch.softmax(scale * qb @ kb.transpose(1, 2), dim=-1)
        out[b] = (weights @ vb).reshape(num_q_heads, head_dim)
        bound[b] = output_error_bound(qb, kb, vb, ek, ev, weights, scale).reshape(num_q_heads, head_dim)
    return out, bound


# (num_q_heads, num_kv_heads, head_dim, block_size, lengths): the engine's GQA 3 at head_dim 64 over a 4K
# context; MQA with 7 query heads at head_dim 96 over pages of 32; MHA with 5 heads at head_dim 36 (a
# remainder after 16- and 8-lane vectors) over pages of 8, lengths around the page size.
CONTRACT_CASES = [
    (9, 3, 64, 16, [4093, 1, 17, 300]),
    (7, 1, 96, 32, [1001, 33, 64]),
    (5, 5, 36, 8, [123, 8, 9, 1]),
]


@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, block_size, lengths", CONTRACT_CASES)
def test_scaled_pages_stay_within_the_bound_their_errors_imply(build, page_dtype, num_q_heads, num_kv_heads,
                                                               head_dim, block_size, lengths):
    lib, isa = build
    q, k, v, slots, tables, lens, num_blocks = sequences_case(
        case_seed("int8-contract", num_q_heads, num_kv_heads, head_dim, block_size), num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, lengths=lengths)
    kc, vc, ks, vs = scaled_pages(lib, k, v, slots, num_blocks, block_size, page_dtype)
    scale = head_dim ** -0.5
    out = poison(torch.empty_like(q))
    assert cpu_kernels.paged_decode_attention_cpu(q, kc, vc, tables, lens, scale, out, library=lib, k_scale=ks,
                                                  v_scale=vs)
    kf, vf = float_pool(k, slots, num_blocks, block_size), float_pool(v, slots, num_blocks, block_size)
    reference, bound = attention64_with_bound(q, kf, vf, page_rows(kc, ks), page_rows(vc, vs), tables, lens, scale)
    error = (out.double() - reference).abs()
    limit = bound + FLOAT32_TOLERANCE * max(float(reference.abs().max()), 1.0)
    worst = float((error / limit).max())
    assert bool(out.isfinite().all()) and worst <= 1.0, (isa, worst)
    # the kernel's own part: attention over what the pages hold, to float32's tolerance
    stored = attention64_with_bound(q, page_rows(kc, ks), page_rows(vc, vs), page_rows(kc, ks), page_rows(vc, vs), tables, lens,
                                    scale)[0]
    assert_close(out, stored, torch.float32)
    # and the stored errors behind the bound meet the per-element contract
    for x, cache, s in ((kf, kc, ks), (vf, vc, vs)):
        e = page_rows(cache, s) - x
        e = e.abs().flatten(0, 1)[slots]
        limit = element_bound(page_dtype, x.flatten(0, 1)[slots],
                              slot_scales(s, slots, page_dtype, block_size, x.shape[-1], rotated=True),
                              rotated=page_dtype == torch.int8)
        assert bool((e <= limit).all()), isa


def test_batch_invariance_is_bit_exact(build, page_dtype):
    """A sequence's output does not depend on the rest of its batch or its place in it."""
    lib, _ = build
    lengths = [700, 3, 129, 64, 1]
    q, k, v, slots, tables, lens, num_blocks = sequences_case(case_seed("int8-batch"), num_q_heads=9,
                                                              num_kv_heads=3, head_dim=64, block_size=16,
                                                              lengths=lengths)
    kc, vc, ks, vs = scaled_pages(lib, k, v, slots, num_blocks, 16, page_dtype)
    together = torch.empty_like(q)
    assert cpu_kernels.paged_decode_attention_cpu(q, kc, vc, tables, lens, 0.125, together, library=lib,
                                                  k_scale=ks, v_scale=vs)
    for b in range(len(lengths)):
        order = [b] + [i for i in range(len(lengths)) if i != b][: b % 3]
        alone = torch.empty_like(q[order])
        assert cpu_kernels.paged_decode_attention_cpu(q[order].contiguous(), kc, vc, tables[order].contiguous(),
                                                      lens[order].contiguous(), 0.125, alone, library=lib,
                                                      k_scale=ks, v_scale=vs)
        assert torch.equal(alone[0], together[b]), b


def _bits(t):
    """A tensor to compare bit for bit: one-byte pages as their bytes, floats with NaN as 0."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.nan_to_num()


def _rope_rows(positions, d):
    angles = torch.tensor(positions, dtype=torch.float32)[:, None] * (
        10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d))[None]
    return torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()


def test_fused_call_is_the_same_however_a_prompt_is_split(build, page_dtype):
    """kl_rope_write_paged_attention on int8 pages: 40 prompt rows of one sequence and a decode row of
    another, in one call, one call per row, and three uneven calls: identical pages, scales and outputs (each
    row attends after its own write, before later rows can requantise its fp8 pages). The outputs are the
    attention over the pages as each row left them: the last row against float64 on the final pages."""
    lib, _ = build
    hq, hkv, d, block_size = 9, 3, 64, 16
    seed = case_seed("int8-fused")
    q0, k, v, slots0, tables, _, num_blocks = sequences_case(seed, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                                             block_size=block_size, lengths=[40, 20])
    positions, rows = list(range(40)) + [19], [0] * 40 + [1]
    slots = torch.tensor([int(tables[r, p // block_size]) * block_size + p % block_size
                          for r, p in zip(rows, positions)])
    # sequence 1's first 19 tokens are already in the pages; the call appends its 20th and all of sequence 0
    base = scaled_pages(lib, k[40:59], v[40:59], slots0[40:59], num_blocks, block_size, page_dtype)
    lens = torch.tensor([p + 1 for p in positions], dtype=torch.int32)
    qkv = randn((41, (hq + 2 * hkv) * d), torch.float32, "cpu", seed + 5) * 3
    qkv[::5] *= 8.0  # rows that grow their page after earlier rows of it were written
    cos, sin = _rope_rows(positions, d)
    row_tables = tables[rows].contiguous()
    results = []
    for splits in ([0, 41], list(range(42)), [0, 7, 30, 41]):
        kc, vc, ks, vs = (t.clone() for t in base)
        out = poison(torch.empty(41, hq * d))
        for lo, hi in zip(splits, splits[1:]):
            cpu_kernels.rope_write_paged_attention_cpu(qkv[lo:hi], cos[lo:hi], sin[lo:hi], slots[lo:hi], kc, vc,
                                                       row_tables[lo:hi], lens[lo:hi], hq, 0.125, out[lo:hi],
                                                       library=lib, k_scale=ks, v_scale=vs)
        results.append((kc, vc, ks, vs, out))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(_bits(a), _bits(b))
    kc, vc, ks, vs, out = results[0]
    assert bool(out.isfinite().all())
    qr = qkv.view(41, -1, d)[:, :hq].double()
    half = d // 2
    qr = qr * cos.double()[:, None] + torch.cat([-qr[..., half:], qr[..., :half]], -1) * sin.double()[:, None]
    expected = paged_attention.paged_decode_attention_reference(
        qr[[39]], page_rows(kc, ks).double(), page_rows(vc, vs).double(), row_tables[[39]], lens[[39]], 0.125)
    assert_close(out.view(41, hq, d)[[39]], expected, torch.float32)


def test_public_op_runs_the_c_kernel_on_scaled_pages(monkeypatch, page_dtype):
    if cpu_kernels.compiler() is None:
        pytest.skip("no C compiler")
    q, k, v, slots, tables, lens, num_blocks = sequences_case(case_seed("int8-op"), num_q_heads=4, num_kv_heads=2,
                                                              head_dim=64, block_size=16, lengths=[50, 7])
    kc, vc, ks, vs = allocate_kv_cache(num_blocks, 16, 2, 64, page_dtype)
    write_kv(k, v, kc, vc, slots, ks, vs)
    reference = paged_decode_attention(q, kc, vc, tables, lens, k_scale=ks, v_scale=vs)  # the C kernel

    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran")
    monkeypatch.setattr(paged_attention, "paged_decode_attention_reference", refuse)
    assert torch.equal(paged_decode_attention(q, kc, vc, tables, lens, k_scale=ks, v_scale=vs), reference)
    monkeypatch.undo()
    monkeypatch.setenv("KERNEL_LAB_CPU_KERNELS", "0")
    fallback = paged_decode_attention(q, kc, vc, tables, lens, k_scale=ks, v_scale=vs)
    assert float((fallback - reference).abs().max()) <= 1e-5 * max(float(reference.abs().max()), 1.0)
    with pytest.raises(ValueError, match=f"v_scale is required with a {page_dtype} cache"):
        paged_decode_attention(q, kc, vc, tables, lens, k_scale=ks)
