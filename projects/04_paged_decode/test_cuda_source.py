"""Project 04: the CUDA source itself, executed on CPU (marker `cuda_source`).

csrc/paged_attention.cu and kernel_common.cuh are compiled as host C++ on the SIMT runtime of
kernel_lab/csrc/simt (kernel_lab/ops/cuda_host.py) and launched through their own `launch_paged_decode`,
with AddressSanitizer and guarded buffers, or with the shared-memory race detector; threads are fibers in a
seeded random order, barriers and warp collectives are checked. Results are compared with the float64
formulation of test_correctness.py, every unread cache slot NaN and the output poisoned. The last tests seed
one defect of each kind into a copy of the source and check that these tests catch it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kernel_lab.harness.testing import assert_close, case_seed, poison, randn
from kernel_lab.ops import cuda_host
from kernel_lab.ops.paged_attention import DECODE_VARIANTS, SplitPlan, plan_splits

_spec = importlib.util.spec_from_file_location("paged_decode_tests", Path(__file__).with_name("test_correctness.py"))
_paged = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_paged)
attention64, make_case, poison_unread_slots = _paged.attention64, _paged.make_case, _paged.poison_unread_slots
windowed_case = _paged.windowed_case
VARIANTS = list(DECODE_VARIANTS)

pytestmark = [pytest.mark.cuda_source,
              pytest.mark.skipif(cuda_host.unavailable() is not None, reason=str(cuda_host.unavailable()))]


# --------------------------------------------------------------------------------------------- helpers
def decode_case(hq, hkv, head_dim, block_size, dtype, cache_dtype=None, plan=None, lengths=None, strided=False,
                seed_parts=()):
    """Inputs for one kernel launch: lengths 0, 1, a page, a page + 1 and the table's maximum (unless given),
    unread slots NaN, `-1` padding in the tables; the plan fixed or from the shapes (132 SMs)."""
    if plan is not None:
        max_blocks = plan.num_splits * plan.partition_blocks - (plan.partition_blocks - 1)
    else:
        max_blocks = max(4, -(-max(lengths or [0]) // block_size))
    lengths = lengths or [0, 1, block_size, block_size + 1, max_blocks * block_size]
    seed = case_seed("cuda-source", hq, hkv, head_dim, block_size, dtype, cache_dtype, plan, lengths, *seed_parts)
    q, kc, vc, bt, sl, ks, vs = make_case(seed, batch=len(lengths), num_q_heads=hq, num_kv_heads=hkv,
                                          head_dim=head_dim, block_size=block_size, lengths=lengths,
                                          max_blocks=max_blocks, dtype=dtype, cache_dtype=cache_dtype)
    if kc.dtype == torch.float8_e4m3fn:  # no NaN assignment for fp8: mark the slots on a float stand-in
        unread = torch.zeros((*kc.shape[:2], 1, 1))
        poison_unread_slots(unread, unread.clone(), bt, sl)
        for cache in (kc, vc):
            cache.view(torch.uint8)[torch.isnan(unread[:, :, 0, 0])] = 0x7F  # E4M3's NaN
    else:
        poison_unread_slots(kc, vc, bt, sl)
    q = q * 2  # logits of a few units: the running max moves along the sequence, so the rescales matter
    out = poison(torch.empty_like(q))
    if strided:  # q and out as slices of wider rows, as the engine's fused QKV gives them
        q = torch.cat([q, randn(q.shape, dtype, "cpu", seed + 9)], dim=2)[:, :, :head_dim]
        out = poison(torch.empty((q.shape[0], hq, 2 * head_dim), dtype=dtype))[:, :, head_dim:]
    plan = plan or plan_splits(len(lengths), hq, hkv, max_blocks, block_size, 132)
    return dict(q=q, k_cache=kc, v_cache=vc, block_tables=bt, seq_lens=sl, k_scale=ks, v_scale=vs, out=out,
                plan=plan)


def run_decode(case, scale=0.3, **options):
    return cuda_host.paged_decode(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                                  case["seq_lens"], scale, case["k_scale"], case["v_scale"], plan=case["plan"],
                                  out=case["out"], **options)


def check_decode(case, scale=0.3, **options):
    out = run_decode(case, scale, **options)
    expected = attention64(case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"],
                           scale, case["k_scale"], case["v_scale"])
    assert_close(out, expected, case["q"].dtype, scale=2.0)
    assert not out[case["seq_lens"] == 0].any(), "a zero-length row must be zeros"
    return out


# --------------------------------------------------------------------------------------------- decode
# (hq, hkv, head_dim, block_size, dtype, plan): every head dim and page size, head tiles 1/2/4/8 (3 query
# heads pad a tile of 4), two head groups, MHA/GQA/MQA, one split, many (with empty ones) and 2-page splits.
DECODE_CASES = [
    (4, 4, 64, 8, torch.float16, None),                                  # MHA, tile 1
    (8, 2, 128, 16, torch.bfloat16, SplitPlan(1, 4, 1, 4)),              # GQA 4, one page per split
    (8, 1, 256, 32, torch.float16, SplitPlan(1, 8, 1, 3)),               # MQA 8, tile 8
    (16, 1, 64, 64, torch.bfloat16, SplitPlan(2, 8, 1, 2)),              # MQA 16: two head groups of 8
    (6, 2, 64, 16, torch.float16, None),                                 # GQA 3 in a tile of 4
    (4, 2, 128, 8, torch.bfloat16, SplitPlan(1, 2, 2, 3)),               # tile 2, two pages per split
    (2, 1, 256, 16, torch.bfloat16, None),                               # head_dim 256, tile 2
    (6, 2, 96, 16, torch.float16, SplitPlan(1, 3, 1, 3)),                # head_dim 96: 12 lanes in 16
    (8, 1, 96, 8, torch.bfloat16, None),                                 # head_dim 96, tile 8
]


# The pipelined variant runs these under the race detector (its cp.async stages are shared memory); its
# ASan runs are the window and fp8 (project 05) tests, and it computes the direct variant's bits (below).
@pytest.mark.parametrize("flavour, variant", [("asan", "direct"), ("race", "direct"), ("race", "pipelined")])
@pytest.mark.parametrize("hq, hkv, head_dim, block_size, dtype, plan", DECODE_CASES)
def test_cuda_decode_matches_float64(hq, hkv, head_dim, block_size, dtype, plan, flavour, variant):
    """asan: bounds of every buffer; race: every shared access (the pipelined variant's cp.async stages, the
    warp merge) checked per barrier interval."""
    check_decode(decode_case(hq, hkv, head_dim, block_size, dtype, plan=plan), flavour=flavour, variant=variant)


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
def test_the_pipelined_variant_computes_the_same_bits_as_the_direct_one(cache_dtype):
    """The variants differ in how the Raws reach the registers, not in the maths."""
    case = decode_case(6, 2, 96, 8, torch.bfloat16, cache_dtype, plan=SplitPlan(1, 3, 2, 3))
    direct = run_decode(case, variant="direct")
    assert torch.equal(run_decode(case, variant="pipelined").view(torch.int16), direct.view(torch.int16))


def test_cuda_decode_with_strided_q_and_out_and_a_long_sequence():
    case = decode_case(8, 2, 128, 16, torch.float16, lengths=[300, 0, 17], strided=True)
    assert case["plan"].num_splits == 1
    out = check_decode(case)
    assert out.stride() != case["q"].contiguous().stride()


def test_cuda_decode_result_does_not_depend_on_thread_or_block_order():
    """The algorithm fixes every summation order, so any schedule of fibers and blocks gives the same bits."""
    case = decode_case(8, 2, 128, 16, torch.bfloat16, plan=SplitPlan(1, 4, 1, 4))
    first = run_decode(case, seed=1)
    for seed in (2, 3):
        assert torch.equal(run_decode(case, seed=seed).view(torch.int16), first.view(torch.int16)), seed
    assert torch.equal(run_decode(case, flavour="race", seed=4).view(torch.int16), first.view(torch.int16))


# Windows with 16-token pages: inside a page, a page exactly, across a page edge, 2.5 pages, past the context.
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("window, dtype, plan", [
    (5, torch.float16, None), (16, torch.bfloat16, SplitPlan(1, 3, 1, 3)), (19, torch.float16, SplitPlan(1, 3, 2, 2)),
    (40, torch.bfloat16, None), (10_000, torch.float16, None),
])
def test_cuda_decode_sliding_window_matches_float64(window, dtype, plan, variant):
    """The slots before each window are NaN and the table entries of pages wholly before it -1 (a read of one
    is an ASan report); forced plans split the window's pages one or two per split."""
    q, kc, vc, bt, sl, expected = windowed_case(case_seed("cuda-window", window, dtype), window, 16, dtype)
    plan = plan or plan_splits(q.shape[0], 6, 2, bt.shape[1], 16, 132, window)
    out = cuda_host.paged_decode(q, kc, vc, bt, sl, 0.2, plan=plan, out=poison(torch.empty_like(q)),
                                 sliding_window=window, variant=variant)
    assert_close(out, expected, dtype, scale=2.0)
    assert torch.equal(out[-1], torch.zeros_like(out[-1])), "a length-0 row must be exactly zero"


@pytest.mark.parametrize("where", [-1, "past_the_pool"])
def test_a_block_table_entry_outside_the_pool_is_an_asan_error(where):
    """Python validation is bypassed: the kernel itself reads page -1 (or the page after the last), which the
    guarded allocations turn into an AddressSanitizer report."""
    case = decode_case(4, 2, 64, 16, torch.float16, lengths=[40, 5])
    case["block_tables"][0, 1] = -1 if where == -1 else case["k_cache"].shape[0]
    with pytest.raises(cuda_host.SimtError, match="AddressSanitizer"):
        run_decode(case)


def test_an_unsupported_head_tile_is_refused_by_the_launcher():
    case = decode_case(4, 4, 64, 8, torch.float16)
    case["plan"] = SplitPlan(1, 9, 1, 1)
    with pytest.raises(cuda_host.SimtError, match="launch returned 1"):
        run_decode(case)


# --------------------------------------------------------------------------------------------- conversions
@pytest.mark.parametrize("arch", [800, 890])
def test_half_and_bf16_conversions_are_bit_exact_over_every_input(arch):
    """Every fp16 and bf16 bit pattern through kernel_common's 8-wide loaders, and floats covering every
    bf16/fp16 value plus the rounding ties between them through __float2half_rn / __float2bfloat16_rn (what
    store_out uses), against torch."""
    x = conversion_inputs()
    got = cuda_host.run("convert", {"x": x}, {}, arch=arch)
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    for name, dtype in (("float_from_half", torch.float16), ("float_from_bf16", torch.bfloat16)):
        expected = every.view(dtype).float()
        assert_same_floats(torch.frombuffer(bytearray(got[name]), dtype=torch.float32), expected, name)
    for name, dtype in (("half_from_float", torch.float16), ("bf16_from_float", torch.bfloat16)):
        actual = torch.frombuffer(bytearray(got[name]), dtype=torch.int16)
        expected = x.to(dtype).view(torch.int16)
        nan = torch.isnan(x)
        assert torch.equal(actual[~nan], expected[~nan]), name
        assert torch.isnan(actual[nan].view(dtype)).all(), name


def test_fast_exp2_on_the_host_is_within_one_ulp_and_flushes_like_ex2_approx_ftz():
    x = torch.cat([torch.linspace(-160, 130, 20001), torch.tensor([float("-inf"), float("inf"), 0.0, -0.0])])
    got = torch.frombuffer(bytearray(cuda_host.run("convert", {"x": x}, {})["exp2"]), dtype=torch.float32)
    exact = torch.exp2(x.double())
    normal = (exact >= 2.0 ** -126) & (exact < 2.0 ** 127)
    ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact)[1] - 24)
    assert float(((got.double() - exact).abs() / ulp)[normal].max()) <= 1.0
    assert not got[~normal & (x < 0)].any(), "results below the normal range flush to +0 (and -inf maps to 0)"
    assert got[-3] == float("inf") and got[-2] == 1.0 and got[-1] == 1.0


def conversion_inputs() -> torch.Tensor:
    """Every bf16 value and every fp16 value as floats, the midpoints between neighbouring fp16 and bf16
    values (round-to-nearest-even ties) and the floats one ulp either side of them."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    values = [every.view(torch.bfloat16).float(), every.view(torch.float16).float()]
    for dtype in (torch.float16, torch.bfloat16):
        finite = every.view(dtype).float()
        finite = finite[torch.isfinite(finite)].double().unique()
        mid = ((finite[1:] + finite[:-1]) / 2).float()
        values += [mid, torch.nextafter(mid, torch.full_like(mid, float("inf"))),
                   torch.nextafter(mid, torch.full_like(mid, float("-inf")))]
    return torch.cat(values).contiguous()


def assert_same_floats(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan), what
    assert torch.equal(actual[~nan].view(torch.int32), expected[~nan].view(torch.int32)), what


# --------------------------------------------------------------------------------------------- the runtime
def selftest(name, flavour="asan"):
    out = torch.full((64 * 9,), -1, dtype=torch.int32)
    return cuda_host.run("selftest", {"in": torch.arange(64, dtype=torch.int32) * 7, "out": out},
                         {"case": name}, flavour=flavour)["out"]


def test_shuffles_and_votes_follow_cuda_semantics():
    out = selftest("shuffles").view(64, 9)
    for t in range(64):
        w, lane = divmod(t, 32)
        v = lambda src, w=w: 100 * w + src  # noqa: E731
        group8, group16 = lane & ~7, lane & ~15
        xor8 = lane ^ 8  # width 8: a later group of 8 is out of reach (own value), an earlier one is not
        expected = [v(lane ^ 5), v(xor8) if xor8 < group8 + 8 else v(lane), v(lane + 3) if lane + 3 < 32 else v(lane),
                    v(lane - 2) if lane - 2 >= group16 else v(lane), v(7), v(group8 + (lane + 3) % 8),
                    0x49249249, 2 * (w == 1), v(lane ^ 1)]
        assert out[t].tolist() == expected, (t, out[t].tolist(), expected)


@pytest.mark.parametrize("name, message", [
    ("mask_misses_a_lane", "__shfl_xor_sync with mask 0xffffffff"),  # its lanes wait, or one has returned
    ("reads_a_lane_outside_the_mask", "reads lane 16, which the mask does not name"),
    ("divergent_barrier", "divergent __syncthreads"),
    ("barrier_then_exit", "divergent __syncthreads"),
    ("collective_against_barrier", "deadlock: waits in __shfl_xor_sync with mask 0xffffffff; lanes 0xffff0000"),
])
def test_wrong_masks_and_divergent_barriers_are_errors(name, message):
    with pytest.raises(cuda_host.SimtError, match=message):
        selftest(name)


@pytest.mark.parametrize("name", ["shared_race", "cp_async_without_wait"])
def test_the_race_detector_reports_unordered_shared_accesses(name):
    with pytest.raises(cuda_host.SimtError, match="race|before any thread of this block wrote it"):
        selftest(name, flavour="race")


def test_ordered_shared_accesses_cp_async_and_dynamic_shared_memory_pass():
    assert selftest("shared_ordered", flavour="race")[:64].tolist() == [63 - (t ^ 1) for t in range(64)]
    assert selftest("cp_async", flavour="race")[:64].tolist() == [7 * (63 - t) for t in range(64)]
    assert selftest("dynamic_shared", flavour="race")[:64].tolist() == [3 * (63 - t) for t in range(64)]


# --------------------------------------------------------------------------------------------- seeded defects
# Each patches one line of a copy of the source (the build fails loudly if the line is not there once) and
# checks that the tests above catch it: a removed barrier (the race detector), a skipped stage of the
# lane-group merge shuffles, an off-by-one token bound (reads a NaN slot past the sequence), a max turned
# into a min in the online softmax.
MUTATIONS = {
    # name: (edits of paged_attention.cu, build flavour, what catches it)
    "removed_barrier": ([("  __syncthreads();\n\n  // Merge the warps", "\n\n  // Merge the warps")], "race",
                        cuda_host.SimtError),
    "skipped_shuffle_stage": ([("for (int offset = kLanes; offset < kWarpSize; offset <<= 1)",
                                "for (int offset = kLanes; offset < kWarpSize / 2; offset <<= 1)")], "asan",
                              AssertionError),
    "off_by_one_bound": ([("valid[c] = offset < pg.tokens;", "valid[c] = offset <= pg.tokens;")], "asan",
                         (AssertionError, cuda_host.SimtError)),  # a NaN slot, or past the pool: ASan
    "swapped_max": ([("const float new_max = fmaxf(run_max[g], chunk_max);",
                      "const float new_max = fminf(run_max[g], chunk_max);")], "asan", AssertionError),
}


@pytest.mark.parametrize("defect", list(MUTATIONS))
def test_a_seeded_defect_fails_the_decode_tests(defect):
    edits, flavour, caught_by = MUTATIONS[defect]
    case = decode_case(8, 2, 64, 8, torch.float16, plan=SplitPlan(1, 4, 2, 2), seed_parts=(defect,))
    check_decode(case, flavour=flavour)  # the unmutated source passes the same check
    with pytest.raises(caught_by):
        check_decode(case, flavour=flavour, mutations={"paged_attention.cu": edits})
