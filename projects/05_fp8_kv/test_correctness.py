"""Project 05 correctness: FP8 E4M3 KV cache with per-page, per-head scales.

CPU: the write policy's error bound in adversarial write orders (hypothesis, in test_write_policy_properties.py),
order independence within a call, the scale rule, non-fp8 write_kv, validation, fp8 decode against float64 and against the fp16 path,
and the storage figure. Compile: FP8 conversions are native instructions on sm_89/sm_90.
GPU (marked): the CUDA write_kv is bit-identical to the reference; fp8 decode against the reference.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from kernel_lab.harness.testing import assert_close, case_seed, error_report, generator, poison, randn
from kernel_lab.ops import allocate_kv_cache, paged_decode_attention, write_kv
from kernel_lab.ops.kv_cache import FP8_DTYPE, kv_cache_bytes, pow2_scale

_spec = importlib.util.spec_from_file_location("paged_decode_tests",
                                               Path(__file__).resolve().parents[1] / "04_paged_decode" /
                                               "test_correctness.py")
_paged = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_paged)
attention64, make_case = _paged.attention64, _paged.make_case

BLOCK_SIZE, HEADS, HEAD_DIM, NUM_BLOCKS = 8, 2, 64, 4


# --------------------------------------------------------------------------------------------- helpers
class ShadowCache:
    """An fp8 cache plus the exact values last written to each slot, to check the bound after each call."""

    def __init__(self, device="cpu", poison_first=False):
        self.k, self.v, self.k_scale, self.v_scale = allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM,
                                                                       FP8_DTYPE, device)
        if poison_first:
            poison(self.k)
            poison(self.v)
        self.truth_k: dict[int, torch.Tensor] = {}
        self.truth_v: dict[int, torch.Tensor] = {}

    def write(self, key, value, slots):
        write_kv(key, value, self.k, self.v, slots, self.k_scale, self.v_scale)
        for i, slot in enumerate(slots.tolist()):
            if slot >= 0:
                self.truth_k[slot] = key[i].double().cpu()
                self.truth_v[slot] = value[i].double().cpu()

    def check_bound(self):
        for cache, scales, truth in ((self.k, self.k_scale, self.truth_k), (self.v, self.v_scale, self.truth_v)):
            assert_scales_are_powers_of_two(scales)
            for slot, exact in truth.items():
                block, offset = divmod(slot, BLOCK_SIZE)
                scale = scales[block].double().cpu()[:, None]                            # [heads, 1]
                stored = cache[block, offset].double().cpu() * scale
                limit = 2.0 ** -4 * exact.abs() + scale * 2.0 ** -9
                excess = (stored - exact).abs() - limit
                assert bool((excess <= 0).all()), (
                    f"slot {slot}: error exceeds the bound by {float(excess.max()):.3e} (scale {scale.flatten()})")


def assert_scales_are_powers_of_two(scales):
    nonzero = scales[scales > 0].double()
    mantissa, _ = torch.frexp(nonzero)
    assert bool((mantissa == 0.5).all()), "a write_kv page scale is not a power of two"


def tokens(n, seed, log2_magnitudes, dtype=torch.float32):
    """n rows of [HEADS, HEAD_DIM], row i scaled by 2**log2_magnitudes[i] (a wide dynamic range per row)."""
    g = generator(seed)
    base = torch.randn((n, HEADS, HEAD_DIM), generator=g) * torch.exp2(torch.rand((n, HEADS, HEAD_DIM), generator=g) * -8)
    return (base * torch.exp2(torch.tensor(log2_magnitudes, dtype=torch.float32))[:, None, None]).to(dtype)


# --------------------------------------------------------------------------------------------- the scale rule
def test_pow2_scale_of_zero_is_zero():
    assert float(pow2_scale(torch.zeros(1))[0]) == 0.0


# --------------------------------------------------------------------------------------------- write policy
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_appends_with_growing_magnitude(dtype):
    """The worst order: one token per call into one page, each larger than everything before it, so the
    page requantises at every append and the early tokens drift into the subnormal range."""
    cache = ShadowCache()
    step = 3 if dtype == torch.float32 else 1  # fp16 overflows past 2**15
    scales_seen = set()
    for t in range(BLOCK_SIZE):
        cache.write(tokens(1, t, [t * step - 8], dtype), tokens(1, 99 + t, [t * step - 8], dtype),
                    torch.tensor([BLOCK_SIZE + t]))
        cache.check_bound()
        scales_seen.add(float(cache.k_scale[1, 0]))
    # The page was requantised at (nearly) every append; its first token drifted towards zero, which the
    # scale * 2**-9 term allows.
    assert len(scales_seen) >= BLOCK_SIZE - 2, scales_seen


def test_prefill_then_appends_matches_one_call_per_token_within_the_bound():
    one_call, per_token = ShadowCache(), ShadowCache()
    mags = [0, 5, -3, 9, 2, 12, -10, 1]
    key, value = tokens(8, 1, mags), tokens(8, 2, mags)
    slots = torch.arange(8) + 2 * BLOCK_SIZE
    one_call.write(key, value, slots)
    for i in range(8):
        per_token.write(key[i:i + 1], value[i:i + 1], slots[i:i + 1])
    one_call.check_bound()
    per_token.check_bound()
    assert torch.equal(one_call.k_scale, per_token.k_scale)


def test_write_order_inside_one_call_does_not_matter():
    slots = torch.tensor([3, 17, 9, -1, 25, 4, 30, 11, 0])
    mags = [4, -6, 0, 8, 13, -2, 1, 20, -15]
    key, value = tokens(9, 5, mags), tokens(9, 6, mags[::-1])
    results = []
    for perm in (torch.arange(9), torch.randperm(9, generator=generator(3)), torch.arange(8, -1, -1)):
        cache = ShadowCache()
        cache.write(tokens(4, 8, [2, 3, 4, 5]), tokens(4, 9, [1, 1, 1, 1]), torch.tensor([1, 2, 16, 24]))
        cache.write(key[perm], value[perm], slots[perm])
        cache.check_bound()
        results.append((cache.k.view(torch.uint8), cache.v.view(torch.uint8), cache.k_scale, cache.v_scale))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_fresh_pages_are_cleared_and_untouched_pages_are_left_alone():
    cache = ShadowCache(poison_first=True)
    cache.write(tokens(1, 1, [0]), tokens(1, 2, [0]), torch.tensor([BLOCK_SIZE + 3]))
    page = cache.k[1].float()
    assert torch.isfinite(page).all(), "an empty page's stale bytes survived its first write"
    assert int((page != 0).any(dim=-1).sum()) == HEADS, "only the written slot holds data"
    assert torch.isnan(cache.k[0].float()).all() and torch.isnan(cache.v[2].float()).all()
    assert float(cache.k_scale[0].abs().sum() + cache.k_scale[2:].abs().sum()) == 0.0


def test_skipped_slots_and_zero_tokens():
    cache = ShadowCache()
    cache.write(tokens(3, 1, [0, 0, 0]), tokens(3, 2, [0, 0, 0]), torch.tensor([-1, -1, -1]))
    assert not cache.k.view(torch.uint8).any() and not cache.k_scale.any()
    zeros = torch.zeros((1, HEADS, HEAD_DIM))
    cache.write(zeros, zeros, torch.tensor([5]))
    assert not cache.k_scale.any(), "an all-zero token needs no scale"
    cache.check_bound()


def test_scale_never_shrinks_including_externally_set_ones():
    cache = ShadowCache()
    cache.k_scale.fill_(3.0)  # not a power of two, set by someone else
    cache.v_scale.fill_(3.0)
    write_kv(tokens(2, 1, [-5, -4]), tokens(2, 2, [-5, -4]), cache.k, cache.v, torch.tensor([0, 9]),
             cache.k_scale, cache.v_scale)
    assert bool((cache.k_scale == 3.0).all())


# --------------------------------------------------------------------------------------------- write_kv misc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_non_fp8_stores_exactly(dtype):
    kc, vc, _, _ = allocate_kv_cache(3, 16, 2, 128, dtype, "cpu")
    poison(kc)
    key, value = randn((5, 2, 128), dtype, "cpu", 1), randn((5, 2, 128), dtype, "cpu", 2)
    write_kv(key, value, kc, vc, torch.tensor([0, 47, -1, 16, 20]))
    assert torch.equal(kc[0, 0], key[0]) and torch.equal(kc[2, 15], key[1]) and torch.equal(vc[1, 4], value[4])
    assert int(torch.isnan(kc.float()).any(dim=-1).sum()) == 3 * 16 * 2 - 4 * 2


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float16, torch.float16), (torch.float32, torch.float32),
                                                 (torch.bfloat16, FP8_DTYPE), (torch.float32, FP8_DTYPE),
                                                 (torch.float32, torch.int8)])
def test_write_kv_bytes_moved_is_what_a_write_touches(dtype, cache_dtype):
    """Against an independent count (nbytes of the inputs and of each stored row and page scale), on a
    steady-state write (the scales already cover the data), checking that nothing else changes."""
    from kernel_lab.ops.kv_cache import write_kv_bytes_moved

    heads, head_dim, block_size = 3, 96, 8
    kc, vc, ks, vs = allocate_kv_cache(5, block_size, heads, head_dim, cache_dtype, "cpu")
    slots = torch.tensor([9, 10, 33, 0, 17])  # pages 1, 1, 4, 0, 2: four pages
    key, value = randn((5, heads, head_dim), dtype, "cpu", 1), randn((5, heads, head_dim), dtype, "cpu", 2)
    write_kv(key * 2, value * 2, kc, vc, slots, ks, vs)  # sets every scale this write needs
    before = [t.clone() for t in (kc, vc) + ((ks, vs) if ks is not None else ())]
    write_kv(key, value, kc, vc, slots, ks, vs)
    blocks, offsets = slots // block_size, slots % block_size
    pages = blocks.unique()
    expected = key.nbytes + value.nbytes + slots.nbytes + kc[blocks, offsets].nbytes + vc[blocks, offsets].nbytes
    if cache_dtype == torch.int8:  # a scale per written token, KV head and 16 channels
        expected += ks[blocks, offsets].nbytes + vs[blocks, offsets].nbytes
    elif ks is not None:
        expected += ks[pages].nbytes + vs[pages].nbytes
    if cache_dtype == FP8_DTYPE:
        assert torch.equal(ks, before[2]) and torch.equal(vs, before[3]), "a steady-state write grew a scale"
    assert write_kv_bytes_moved(5, heads, head_dim, dtype, cache_dtype, len(pages)) == expected
    untouched = torch.ones(kc.shape[:2], dtype=torch.bool)
    untouched[blocks, offsets] = False
    for cache, old in zip((kc, vc), before):
        assert torch.equal(cache[untouched].view(torch.uint8), old[untouched].view(torch.uint8))


@pytest.mark.parametrize("call, error, pattern", [
    (lambda c: write_kv(c["key"], c["value"].half(), c["k"], c["v"], c["slots"]), TypeError, "value must have dtype"),
    (lambda c: write_kv(c["key"].half(), c["value"].half(), c["k"], c["v"], c["slots"]), TypeError,
     "key must have dtype"),
    (lambda c: write_kv(c["key"], c["value"], c["k"], c["v"], c["slots"].int()), TypeError, "slot_mapping"),
    (lambda c: write_kv(c["key"][:, :1], c["value"], c["k"], c["v"], c["slots"]), ValueError, "key must have shape"),
    (lambda c: write_kv(c["key"], c["value"], c["k"], c["v"], c["slots"][:2]), ValueError, "key must have shape"),
    (lambda c: write_kv(c["key"], c["value"], c["k"], c["v"], torch.tensor([0, 1, 48])), ValueError,
     r"slot_mapping values .* \[0, 48\)"),
    (lambda c: write_kv(c["key"], c["value"], c["k"], c["v"], torch.tensor([0, -2, 1])), ValueError,
     "slot_mapping values"),
    (lambda c: write_kv(c["key"], c["value"], c["k8"], c["v8"], c["slots"]), ValueError, "k_scale is required"),
    (lambda c: write_kv(c["key"], c["value"], c["k8"], c["v8"], c["slots"], c["ks"], c["ks"][:1]), ValueError,
     "v_scale must have shape"),
    (lambda c: write_kv(c["key"], c["value"], c["k8"], c["v"], c["slots"], c["ks"], c["ks"]), TypeError,
     "v_cache must have dtype"),
])
def test_write_kv_bad_input(call, error, pattern):
    k, v, _, _ = allocate_kv_cache(3, 16, 2, 64, torch.float32, "cpu")
    k8, v8, ks, _ = allocate_kv_cache(3, 16, 2, 64, FP8_DTYPE, "cpu")
    ctx = dict(key=randn((3, 2, 64), torch.float32, "cpu", 1), value=randn((3, 2, 64), torch.float32, "cpu", 2),
               k=k, v=v, k8=k8, v8=v8, ks=ks, slots=torch.tensor([0, 5, 40]))
    with pytest.raises(error, match=pattern):
        call(ctx)


# --------------------------------------------------------------------------------------------- fp8 decode
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq, hkv, head_dim, block_size", [(8, 8, 128, 16), (16, 2, 64, 32), (4, 1, 256, 8),
                                                     (6, 2, 96, 16)])
def test_fp8_decode_matches_float64_over_dequantised_cache(hq, hkv, head_dim, block_size, dtype):
    lengths = [1, block_size, block_size + 1, 4 * block_size]
    seed = case_seed("fp8-decode", hq, hkv, head_dim, block_size, dtype)
    q, kc, vc, bt, sl, ks, vs = make_case(seed, batch=4, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                                          block_size=block_size, lengths=lengths, max_blocks=4, dtype=dtype,
                                          cache_dtype=FP8_DTYPE)
    out = poison(torch.empty_like(q))
    paged_decode_attention(q, kc, vc, bt, sl, k_scale=ks, v_scale=vs, out=out)
    assert_close(out, attention64(q, kc, vc, bt, sl, head_dim ** -0.5, ks, vs), dtype)


def test_fp8_decode_error_against_the_fp16_path_is_small():
    """Same tokens written into an fp16 and an fp8 cache: the decode outputs differ only by E4M3 rounding."""
    seed, lengths = 11, [300, 64, 1, 129]
    q, kc16, vc16, bt, sl, _, _ = make_case(seed, batch=4, num_q_heads=8, num_kv_heads=2, head_dim=128,
                                            block_size=16, lengths=lengths, dtype=torch.float16)
    k8, v8, ks, vs = allocate_kv_cache(kc16.shape[0], 16, 2, 128, FP8_DTYPE, "cpu")
    slots = torch.arange(kc16.shape[0] * 16)
    write_kv(kc16.reshape(-1, 2, 128), vc16.reshape(-1, 2, 128), k8, v8, slots, ks, vs)
    out16 = paged_decode_attention(q, kc16, vc16, bt, sl)
    out8 = paged_decode_attention(q, k8, v8, bt, sl, k_scale=ks, v_scale=vs)
    report = error_report(out8, out16.double())
    assert report.rel_l2 < 0.05 and report.max_abs < 0.06 * report.ref_max, report
    assert report.rel_l2 > 1e-4, "the fp8 path is suspiciously identical to fp16"


def test_storage_saved_against_fp16():
    fp16 = kv_cache_bytes(1000, 16, 8, 128, torch.float16)
    fp8 = kv_cache_bytes(1000, 16, 8, 128, FP8_DTYPE)
    kc, vc, ks, vs = allocate_kv_cache(10, 16, 8, 128, FP8_DTYPE, "cpu")
    actual = sum(t.numel() * t.element_size() for t in (kc, vc, ks, vs))
    assert actual == kv_cache_bytes(10, 16, 8, 128, FP8_DTYPE)
    assert 1 - fp8 / fp16 >= 0.495


# --------------------------------------------------------------------------------------------- compile
@pytest.fixture(scope="module")
def compiled():
    from kernel_lab.ops.cuda_extension import compile_kernels

    return compile_kernels("kv_cache")


def test_kv_cache_kernels_build_without_spills(compiled):
    assert set(compiled) == {80, 89, 90}
    for capability, report in compiled.items():
        assert report["spill_stores"] == 0 and report["spill_loads"] == 0, (capability, report["log"][-3000:])


def test_fp8_conversions_are_native_on_sm89_and_sm90(compiled):
    for capability in (89, 90):
        sass = compiled[capability]["sass"]
        assert re.search(r"\bF2FP\.SATFINITE\.E4M3\.F32\.PACK_AB", sass), f"sm_{capability}: no native fp32->e4m3"
    # sm_80 has no FP8 hardware: its conversion is emulated in integer code.
    assert "E4M3" not in compiled[80]["sass"]


@pytest.fixture(scope="module")
def compiled_attention():
    from kernel_lab.ops.cuda_extension import compile_kernels

    return compile_kernels("paged_attention")


def test_fp8_decode_dequantises_with_native_instructions(compiled_attention):
    for capability in (89, 90):
        sass = compiled_attention[capability]["sass"]
        assert re.search(r"\bF2FP\.F16\.E4M3\.UNPACK_B|\bHADD2\.F32", sass) or "E4M3" in sass, capability


# --------------------------------------------------------------------------------------------- non-finite
def nonfinite_calls():
    """Three write_kv calls that carry NaN and +-inf among finite values: into an empty page, into a page
    with data (no growth), then a larger finite token that makes that page requantise its NaN and inf."""
    key, value = tokens(3, 7, [0, 2, -1]), tokens(3, 8, [1, 0, 3])
    key[0, 0, 5], key[1, 1, 0], value[2, 0, 9] = float("nan"), float("inf"), float("-inf")
    value[0, 1, :] = float("nan")  # a whole row non-finite: its token takes no part in the scale
    first = (key, value, torch.tensor([0, 1, 2 * BLOCK_SIZE]))
    key2, value2 = tokens(2, 9, [-2, -3]), tokens(2, 10, [-1, -2])
    key2[0, 0, 1], value2[1, 1, 3] = float("inf"), float("nan")
    second = (key2, value2, torch.tensor([2, 2 * BLOCK_SIZE + 1]))
    third = (tokens(1, 11, [9]), tokens(1, 12, [9]), torch.tensor([3]))
    return [first, second, third]


def fp8_bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal E4M3 caches: same NaN positions (0x7f or 0xff: the sign of a NaN is not part of the contract)
    and identical bytes everywhere else."""
    a, b = a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu()
    nan_a, nan_b = (a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])


def test_non_finite_inputs_keep_nan_saturate_inf_and_never_set_a_scale():
    cache = ShadowCache()
    finite_amax = {}
    for key, value, slots in nonfinite_calls():
        cache.write(key, value, slots)
        for i, slot in enumerate(slots.tolist()):
            block = slot // BLOCK_SIZE
            for name, x in (("k", key[i]), ("v", value[i])):
                finite = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).amax(dim=-1)
                finite_amax[name, block] = torch.maximum(finite_amax.get((name, block), finite), finite)
        for name, scales in (("k", cache.k_scale), ("v", cache.v_scale)):
            for (which, block), amax in finite_amax.items():
                if which == name:  # the scale follows the finite values only
                    assert torch.equal(scales[block], pow2_scale(amax)), (name, block)
        for slot, (key_row, value_row) in {int(s): (k, v) for k, v, s in zip(key, value, slots)}.items():
            block, offset = divmod(slot, BLOCK_SIZE)
            for x, page, scales in ((key_row, cache.k, cache.k_scale), (value_row, cache.v, cache.v_scale)):
                stored = page[block, offset].float() * scales[block][:, None]
                assert torch.equal(torch.isnan(stored), torch.isnan(x)), "NaN must stay NaN, and only NaN"
                inf = torch.isinf(x)
                expected = torch.sign(x[inf]) * 448 * scales[block][:, None].expand_as(x)[inf]
                assert torch.equal(stored[inf], expected), "inf saturates to +-448 * scale"
    # The last call grew page 0's scale: its NaN survived the requantisation, its inf stayed the page maximum.
    assert bool(torch.isnan(cache.k[0, 0, 0, 5].float()))
    assert float(cache.k[0, 1, 1, 0].float()) * float(cache.k_scale[0, 1]) <= 448 * float(cache.k_scale[0, 1])
    assert bool(torch.isnan(cache.v[0, 0, 1].float()).all())


def test_cuda_write_kv_source_follows_the_non_finite_rule():
    """Without a GPU, the CUDA side of the rule is checked in its source (the GPU test above checks bytes):
    every amax goes through finite_abs and every clamp through the NaN-keeping clamp_fp8_range."""
    source = (Path(__file__).resolve().parents[2] / "kernel_lab" / "csrc" / "kv_cache.cu").read_text()
    assert "isfinite(x) ? fabsf(x) : 0.0f" in source and "isnan(x) ? x :" in source
    assert len(re.findall(r"_max = fmaxf\(\w_max, finite_abs\(", source)) == 2
    assert not re.search(r"fminf\(fmaxf\(f\[e\]", source), "a clamp that turns NaN into a bound"


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.cuda_extension
def test_gpu_write_kv_is_bit_identical_to_the_reference():
    calls = [(torch.arange(0, 20), 0), (torch.tensor([20, 3, -1, 21, 7]), 6), (torch.tensor([26, 27, 1]), 12),
             (torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=generator(1)), -3)]
    cpu, gpu = ShadowCache(poison_first=True), ShadowCache("cuda", poison_first=True)
    for i, (slots, mag) in enumerate(calls):
        mags = [mag + (j % 5) for j in range(slots.numel())]
        for dtype in (torch.float32, torch.bfloat16):
            key, value = tokens(slots.numel(), i, mags, dtype), tokens(slots.numel(), 50 + i, mags, dtype)
            cpu.write(key, value, slots)
            gpu.write(key.cuda(), value.cuda(), slots.cuda())
            for a, b in ((cpu.k, gpu.k), (cpu.v, gpu.v), (cpu.k_scale, gpu.k_scale), (cpu.v_scale, gpu.v_scale)):
                assert torch.equal(a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                                   (b.view(torch.uint8) if b.dtype == FP8_DTYPE else b).cpu())
    gpu.check_bound()


@pytest.mark.gpu
@pytest.mark.cuda_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_write_kv_matches_the_reference_on_non_finite_inputs(dtype):
    """NaN and inf: the CUDA kernels follow the reference's rule (scales from finite values, NaN kept through
    requantisation, inf saturated), checked byte for byte after every call."""
    cpu, gpu = ShadowCache(), ShadowCache("cuda")
    for key, value, slots in nonfinite_calls():
        key, value = key.to(dtype), value.to(dtype)
        cpu.write(key, value, slots)
        gpu.write(key.cuda(), value.cuda(), slots.cuda())
        assert torch.equal(cpu.k_scale, gpu.k_scale.cpu()) and torch.equal(cpu.v_scale, gpu.v_scale.cpu())
        assert fp8_bytes_equal(cpu.k, gpu.k) and fp8_bytes_equal(cpu.v, gpu.v)


@pytest.mark.gpu
@pytest.mark.cuda_extension
@pytest.mark.parametrize("batch, hq, hkv, head_dim, block_size, max_len", [
    (1, 32, 32, 128, 16, 16384), (16, 32, 8, 128, 16, 2000), (7, 8, 1, 256, 64, 3000), (40, 16, 16, 64, 8, 500),
    (6, 32, 8, 96, 16, 1500),  # Phi-3's head_dim
])
@pytest.mark.parametrize("variant", ["direct", "pipelined"])
def test_gpu_fp8_decode_matches_reference(batch, hq, hkv, head_dim, block_size, max_len, variant):
    g = generator(case_seed("fp8-gpu", batch, max_len))
    lengths = torch.randint(1, max_len + 1, (batch,), generator=g).tolist()
    lengths[0] = max_len
    q, kc, vc, bt, sl, ks, vs = make_case(case_seed("fp8-gpu", batch, hq, hkv), batch=batch, num_q_heads=hq,
                                          num_kv_heads=hkv, head_dim=head_dim, block_size=block_size,
                                          lengths=lengths, dtype=torch.bfloat16, cache_dtype=FP8_DTYPE,
                                          device="cuda")
    out = paged_decode_attention(q, kc, vc, bt, sl, k_scale=ks, v_scale=vs, validate=True, variant=variant)
    reference = paged_decode_attention_reference_on(q, kc, vc, bt, sl, ks, vs)
    assert_close(out, reference, torch.bfloat16, scale=2.0)
    _paged.assert_float64_subsample(out, q, kc, vc, bt, sl, torch.bfloat16, ks, vs)


def paged_decode_attention_reference_on(q, kc, vc, bt, sl, ks, vs):
    from kernel_lab.ops.paged_attention import paged_decode_attention_reference

    return paged_decode_attention_reference(q, kc, vc, bt, sl, None, ks, vs).double()
