"""Project 05 property tests (hypothesis): the pow2 scale rule over the whole fp32 range, and the write
policy's error bound in any order of writes. Their own module so that the rest of 05's tests still run where
hypothesis is not installed (the bare GPU box)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kernel_lab.ops.kv_cache import MIN_FP8_SCALE, pow2_scale  # noqa: E402

_spec = importlib.util.spec_from_file_location("fp8_kv_tests", Path(__file__).with_name("test_correctness.py"))
_fp8 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fp8)
BLOCK_SIZE, NUM_BLOCKS, ShadowCache, tokens = _fp8.BLOCK_SIZE, _fp8.NUM_BLOCKS, _fp8.ShadowCache, _fp8.tokens


@given(st.floats(min_value=2.0 ** -140, max_value=2.0 ** 127, allow_nan=False, allow_infinity=False, width=32))
@settings(max_examples=300, deadline=None)
def test_pow2_scale_is_the_smallest_power_of_two_covering_the_range(amax):
    scale = float(pow2_scale(torch.tensor([amax], dtype=torch.float32))[0])
    assert torch.frexp(torch.tensor(scale))[0] == 0.5
    assert amax / scale <= 448 * (1 + 2 ** -23)
    assert scale == MIN_FP8_SCALE or amax / scale > 224 * (1 - 2 ** -23)


# A write event: a list of (slot, log2 magnitude) tokens written by one write_kv call.
write_event = st.lists(st.tuples(st.integers(-1, NUM_BLOCKS * BLOCK_SIZE - 1), st.integers(-30, 30)),
                       min_size=1, max_size=6)


@given(events=st.lists(write_event, min_size=1, max_size=8), seed=st.integers(0, 2 ** 16))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_error_bound_holds_in_any_write_order(events, seed):
    cache = ShadowCache(poison_first=True)
    for i, event in enumerate(events):
        slots = torch.tensor([s for s, _ in event], dtype=torch.int64)
        mags = [m for _, m in event]
        # A slot listed twice in one call leaves either value: keep one writer per slot per call.
        _, first = torch.unique(slots, return_inverse=True)
        keep = [j for j in range(len(event)) if slots[j] < 0 or int((first[:j] == first[j]).sum()) == 0]
        cache.write(tokens(len(keep), seed + i, [mags[j] for j in keep]),
                    tokens(len(keep), seed + 1000 + i, [-mags[j] for j in keep]), slots[keep])
        cache.check_bound()
