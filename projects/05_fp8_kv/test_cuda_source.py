"""Project 05: the CUDA source of write_kv and of the fp8 decode, executed on CPU (marker `cuda_source`).

csrc/kv_cache.cu and paged_attention.cu run on the SIMT runtime of kernel_lab/csrc/simt (see
projects/04_paged_decode/test_cuda_source.py for the mechanics): write_kv must be byte-identical to the
reference policy of kernel_lab/ops/kv_cache.py after every call (the policy fixes every result), fp8 decode
must match float64 for both fp8 code paths (sm_80's bit trick, sm_89's native conversion), and every E4M3
conversion is checked over all inputs. Seeded defects in kv_cache.cu must fail these tests.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kernel_lab.harness.testing import generator, poison, randn
from kernel_lab.ops import cuda_host, write_kv
from kernel_lab.ops.kv_cache import FP8_DTYPE
from kernel_lab.ops.paged_attention import SplitPlan


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_here = Path(__file__).resolve().parent
_fp8 = _load(_here / "test_correctness.py", "fp8_kv_tests")
_source04 = _load(_here.parent / "04_paged_decode" / "test_cuda_source.py", "paged_decode_cuda_source_tests")
ShadowCache, tokens, nonfinite_calls, fp8_bytes_equal = (_fp8.ShadowCache, _fp8.tokens, _fp8.nonfinite_calls,
                                                         _fp8.fp8_bytes_equal)
BLOCK_SIZE, NUM_BLOCKS = _fp8.BLOCK_SIZE, _fp8.NUM_BLOCKS

pytestmark = [pytest.mark.cuda_source,
              pytest.mark.skipif(cuda_host.unavailable() is not None, reason=str(cuda_host.unavailable()))]


class HostShadow(ShadowCache):
    """ShadowCache whose writes run the CUDA source (kv_cache.cu) on the SIMT runtime."""

    def __init__(self, poison_first=False, **run_options):
        super().__init__("cpu", poison_first)
        self.run_options = run_options

    def write(self, key, value, slots):
        cuda_host.write_kv(key, value, self.k, self.v, slots, self.k_scale, self.v_scale, **self.run_options)
        for i, slot in enumerate(slots.tolist()):
            if slot >= 0:
                self.truth_k[slot] = key[i].double()
                self.truth_v[slot] = value[i].double()


def same_cache(a: ShadowCache, b: ShadowCache) -> bool:
    return (torch.equal(a.k.view(torch.uint8), b.k.view(torch.uint8)) and
            torch.equal(a.v.view(torch.uint8), b.v.view(torch.uint8)) and
            torch.equal(a.k_scale, b.k_scale) and torch.equal(a.v_scale, b.v_scale))


# A prefill of three pages, appends that grow pages (one of them fresh), a skipped slot, then every slot of
# the pool in a random order at a lower magnitude.
WRITE_CALLS = [(torch.arange(0, 20), 0), (torch.tensor([20, 3, -1, 21, 7]), 6), (torch.tensor([26, 27, 1]), 12),
               (torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=generator(1)), -3)]


def check_write_sequence(dtypes=(torch.float32, torch.bfloat16, torch.float16), **run_options):
    reference, host = ShadowCache(poison_first=True), HostShadow(poison_first=True, **run_options)
    for i, (slots, magnitude) in enumerate(WRITE_CALLS):
        mags = [magnitude + (j % 5) for j in range(slots.numel())]
        for dtype in dtypes:
            key, value = tokens(slots.numel(), i, mags, dtype), tokens(slots.numel(), 50 + i, mags, dtype)
            reference.write(key, value, slots)
            host.write(key, value, slots)
            assert same_cache(reference, host), (i, dtype)
    host.check_bound()


# --------------------------------------------------------------------------------------------- write_kv
def test_cuda_write_kv_is_bit_identical_to_the_reference_policy():
    check_write_sequence()


def test_cuda_write_kv_under_the_race_detector_and_other_schedules():
    check_write_sequence(dtypes=(torch.bfloat16,), flavour="race", seed=5)
    check_write_sequence(dtypes=(torch.float32,), arch=800, seed=9)


def test_cuda_write_kv_requantises_on_every_growing_append():
    """One token per call into one page, each larger than all before: the leader requantises the page at
    every append (the order of tokens within a call is irrelevant; across calls the scale only grows)."""
    reference, host = ShadowCache(), HostShadow()
    scales_seen = set()
    for t in range(BLOCK_SIZE):
        key, value = tokens(1, t, [3 * t - 8]), tokens(1, 99 + t, [3 * t - 8])
        slot = torch.tensor([BLOCK_SIZE + t])
        reference.write(key, value, slot)
        host.write(key, value, slot)
        assert same_cache(reference, host), t
        scales_seen.add(float(host.k_scale[1, 0]))
    host.check_bound()
    assert len(scales_seen) >= BLOCK_SIZE - 2, scales_seen  # the page grew (and was requantised) at each append


def test_cuda_write_kv_non_finite_inputs_follow_the_reference():
    reference, host = ShadowCache(), HostShadow()
    for key, value, slots in nonfinite_calls():
        reference.write(key, value, slots)
        host.write(key, value, slots)
        assert torch.equal(reference.k_scale, host.k_scale) and torch.equal(reference.v_scale, host.v_scale)
        assert fp8_bytes_equal(reference.k, host.k) and fp8_bytes_equal(reference.v, host.v)


@pytest.mark.parametrize("head_dim, block_size, heads", [(128, 16, 3), (256, 32, 1), (64, 64, 2), (96, 16, 3)])
def test_cuda_write_kv_fp8_other_head_dims_and_page_sizes(head_dim, block_size, heads):
    from kernel_lab.ops import allocate_kv_cache

    caches = [allocate_kv_cache(5, block_size, heads, head_dim, FP8_DTYPE, "cpu") for _ in range(2)]
    for c in caches:
        poison(c[0]), poison(c[1])
    slots_per_call = [torch.tensor([block_size + 1, 3, -1, 4 * block_size - 1]), torch.tensor([block_size + 2, 0])]
    for i, slots in enumerate(slots_per_call):
        key = randn((slots.numel(), heads, head_dim), torch.float32, "cpu", 10 + i, scale=4.0 ** i)
        value = randn((slots.numel(), heads, head_dim), torch.float32, "cpu", 20 + i, scale=3.0 ** i)
        write_kv(key, value, *caches[0][:2], slots, *caches[0][2:])
        cuda_host.write_kv(key, value, *caches[1][:2], slots, *caches[1][2:])
        for a, b in zip(caches[0], caches[1]):
            assert torch.equal(a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                               b.view(torch.uint8) if b.dtype == FP8_DTYPE else b), i


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_write_kv_same_dtype_caches_copy_rows_exactly(dtype):
    from kernel_lab.ops import allocate_kv_cache

    kc, vc, _, _ = allocate_kv_cache(3, 16, 2, 128, dtype, "cpu")
    poison(kc), poison(vc)
    key, value = randn((5, 2, 128), dtype, "cpu", 1), randn((5, 2, 128), dtype, "cpu", 2)
    slots = torch.tensor([0, 47, -1, 16, 20])
    expected_k, expected_v = kc.clone(), vc.clone()
    write_kv(key, value, expected_k, expected_v, slots)
    cuda_host.write_kv(key, value, kc, vc, slots)
    assert torch.equal(kc.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), expected_v.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", [FP8_DTYPE, torch.float16])
def test_a_slot_past_the_pool_is_an_asan_error(cache_dtype):
    """Python validation bypassed: the kernels write (or requantise) a page after the last one."""
    from kernel_lab.ops import allocate_kv_cache

    kc, vc, ks, vs = allocate_kv_cache(2, 8, 2, 64, cache_dtype, "cpu")
    key = randn((2, 2, 64), torch.float32 if cache_dtype == FP8_DTYPE else cache_dtype, "cpu", 3)
    with pytest.raises(cuda_host.SimtError, match="AddressSanitizer"):
        cuda_host.write_kv(key, key.clone(), kc, vc, torch.tensor([3, 2 * 8]), ks, vs)


# --------------------------------------------------------------------------------------------- fp8 decode
@pytest.mark.parametrize("arch, flavour", [(800, "asan"), (890, "asan"), (890, "race")])
@pytest.mark.parametrize("hq, hkv, head_dim, block_size, dtype, plan", [
    (8, 2, 64, 16, torch.bfloat16, SplitPlan(1, 4, 1, 3)),
    (4, 1, 256, 8, torch.float16, None),
    (2, 2, 128, 32, torch.bfloat16, SplitPlan(1, 1, 2, 2)),
    (6, 2, 96, 16, torch.float16, SplitPlan(1, 3, 1, 3)),   # head_dim 96: 12 lanes of data in a group of 16
])
@pytest.mark.parametrize("variant", ["direct", "pipelined"])
def test_cuda_fp8_decode_matches_float64(arch, flavour, hq, hkv, head_dim, block_size, dtype, plan, variant):
    case = _source04.decode_case(hq, hkv, head_dim, block_size, dtype, cache_dtype=FP8_DTYPE, plan=plan)
    _source04.check_decode(case, arch=arch, flavour=flavour, variant=variant)


# --------------------------------------------------------------------------------------------- conversions
@pytest.mark.parametrize("arch", [800, 890])
def test_fp8_conversions_are_bit_exact_over_every_input(arch):
    """All 256 E4M3 bytes through the decode (sm_80: the fp16 bit trick with its 2^8 fold; sm_89: the
    native cvt) and floats covering every fp16/bf16 value, every E4M3 value, the ties between E4M3 values and
    their neighbours through float8_to_fp8x8 (RNE, SATFINITE), against torch."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
    finite = every[torch.isfinite(every)].double().unique()
    mid = ((finite[1:] + finite[:-1]) / 2).float()
    x = torch.cat([_source04.conversion_inputs(), every, mid, torch.nextafter(mid, torch.full_like(mid, 1e9)),
                   torch.nextafter(mid, torch.full_like(mid, -1e9)), torch.tensor([449.0, -464.0, 1e30])])
    got = cuda_host.run("convert", {"x": x.contiguous()}, {}, arch=arch)
    fold = torch.frombuffer(bytearray(got["fp8_fold"]), dtype=torch.float32)
    assert float(fold) == (256.0 if arch == 800 else 1.0)
    decoded = torch.frombuffer(bytearray(got["float_from_fp8"]), dtype=torch.float32)
    _source04.assert_same_floats(decoded, every, "fp8 -> float")
    folded = torch.frombuffer(bytearray(got["float_from_fp8_folded"]), dtype=torch.float32)
    _source04.assert_same_floats(folded * fold, every, "fp8 -> float, folded")
    encoded = torch.frombuffer(bytearray(got["fp8_from_float"]), dtype=torch.uint8)
    nan = torch.isnan(x)
    expected = x.clamp(-448.0, 448.0).to(FP8_DTYPE).view(torch.uint8)  # SATFINITE: inf and overflow saturate
    assert torch.equal(encoded[~nan], expected[~nan])
    assert bool(((encoded[nan] & 0x7F) == 0x7F).all()), "NaN encodes as E4M3's NaN"


# --------------------------------------------------------------------------------------------- seeded defects
KV_MUTATIONS = {
    # a requantisation loop that runs one row past the page, a max turned into a min in the amax, the row
    # amax's last shuffle stage skipped (kernel_common.cuh's group_max), the __syncwarp that keeps lane 0 from
    # publishing the new scale before its row mates have read the old one
    "off_by_one_bound": ("kv_cache.cu", [("offset < (r.holds_data ? p.block_size : 0); ++offset)",
                                          "offset <= (r.holds_data ? p.block_size : 0); ++offset)")]),
    "swapped_max": ("kv_cache.cu", [("k_max = fmaxf(k_max, finite_abs(k[e]));",
                                     "k_max = fminf(k_max, finite_abs(k[e]));")]),
    "skipped_shuffle_stage": ("kernel_common.cuh", [("offset > 0; offset >>= 1) v = fmaxf",
                                                     "offset > 1; offset >>= 1) v = fmaxf")]),
    "removed_syncwarp": ("kv_cache.cu", [("  __syncwarp(row_lanes);\n", "  (void)row_lanes;\n")]),
}


@pytest.mark.parametrize("defect", list(KV_MUTATIONS))
def test_a_seeded_defect_fails_the_write_kv_tests(defect):
    source, edits = KV_MUTATIONS[defect]
    with pytest.raises((AssertionError, cuda_host.SimtError)):
        check_write_sequence(dtypes=(torch.float32,), mutations={source: edits})
