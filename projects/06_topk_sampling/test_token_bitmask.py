"""Project 06 correctness: a grammar's packed token bitmask applied to logits in place.

Each path (Triton: on the GPU, or through the interpreter on CPU; the plain-C CPU kernel; the PyTorch
reference) is compared bit for bit with an independent per-token definition below, which reads bit j of a
row as `(word[j // 32] >> (j % 32)) & 1` by gathering. Inputs carry NaN in allowed and disallowed places
(an allowed NaN must stay NaN, a disallowed one becomes -inf), and strided cases surround the view with
sentinels that no path may touch. xgrammar's own CPU implementation is a second, external check.
"""

from __future__ import annotations

import re

import pytest
import torch

import kernel_lab.ops.token_bitmask as tb
from kernel_lab.harness.compile import TARGETS, check_no_spills, compile_module
from kernel_lab.harness.testing import case_seed, generator, randn
from kernel_lab.ops import apply_token_bitmask

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
SENTINEL = 12345.0


# --- independent definitions ---------------------------------------------------------------------------
def random_bitmask(n: int, vocab: int, seed: int, density: float = 0.5) -> torch.Tensor:
    """Random bits (each allowed with probability `density`), with some all-ones and all-zero words."""
    g = generator(seed)
    words = (vocab + 31) // 32
    bits = (torch.rand(n, words, 32, generator=g) < density).long()
    packed = (bits << torch.arange(32)).sum(-1)  # int64 in [0, 2^32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    pick = torch.rand(n, words, generator=g)
    packed[pick < 0.1] = -1
    packed[pick > 0.95] = 0
    return packed


def expected(logits: torch.Tensor, bitmask: torch.Tensor, rows) -> torch.Tensor:
    """The result in float64 (NaN kept), token by token: bit j of a row is word j // 32 shifted by j % 32."""
    out = logits.double().clone()
    token = torch.arange(logits.shape[1])
    targets = range(bitmask.shape[0]) if rows is None else rows.tolist()
    for i, r in enumerate(targets):
        bit = (bitmask[i].long()[token // 32] >> (token % 32)) & 1
        out[r] = torch.where(bit == 1, out[r], torch.tensor(float("-inf"), dtype=torch.float64))
    return out


def assert_bits_equal(actual: torch.Tensor, want64: torch.Tensor) -> None:
    want = want64.to(actual.dtype)
    a, w = actual.cpu().view(BITS[actual.dtype]), want.view(BITS[actual.dtype])
    assert torch.equal(a, w), f"{int((a != w).sum())} of {a.numel()} elements differ"


def logits_with_nans(shape, dtype, seed) -> torch.Tensor:
    x = randn(shape, torch.float32, "cpu", seed, scale=3.0)
    x[torch.rand(shape, generator=generator(seed + 1)) < 0.01] = float("nan")
    x.view(-1)[0] = float("inf")
    return x.to(dtype)


@pytest.fixture(params=["triton", "c", "reference"])
def path(request, device, monkeypatch):
    """The device each path runs on; "c" and "reference" are CPU paths, forced and checked to be taken."""
    if request.param == "triton":
        return device
    if device.type == "cuda":
        pytest.skip("CPU paths: tested on the CPU machine")
    if request.param == "c":
        forbid = request.getfixturevalue("c_kernels_only")
        forbid(tb, "apply_token_bitmask_reference")
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        monkeypatch.setenv("KERNEL_LAB_CPU_KERNELS", "0")
    return torch.device("cpu")


CASES = [  # batch, vocab, rows (None: every row has a mask)
    (3, 49152 + 7, [2, 0]),
    (2, 1, None),
    (4, 33, [3, 1, 1]),  # a duplicate row: the two masks combine
    (3, 32, [0]),
    (1, 31, None),
    (5, 1000, [4, 0, 2]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, vocab, rows", CASES)
def test_matches_the_per_token_definition(batch, vocab, rows, dtype, path):
    seed = case_seed("bitmask", batch, vocab, rows, dtype)
    x = logits_with_nans((batch, vocab), dtype, seed)
    n = batch if rows is None else len(rows)
    mask = random_bitmask(n, vocab, seed + 2)
    idx = None if rows is None else torch.tensor(rows)
    want = expected(x, mask, idx)
    got = x.to(path)
    assert apply_token_bitmask(got, mask.to(path), None if idx is None else idx.to(path)) is got
    assert_bits_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_logits_touch_nothing_outside_the_view(dtype, path):
    vocab, seed = 999, case_seed("strided", dtype)
    base = torch.full((6, 2 * vocab + 5), SENTINEL, dtype=dtype)
    view = base[1::2, 3:3 + 2 * vocab:2]  # row stride 2 * (2V + 5), column stride 2
    view.copy_(logits_with_nans((3, vocab), dtype, seed))
    mask, rows = random_bitmask(2, vocab, seed), torch.tensor([2, 0], dtype=torch.int32)
    want = base.double().clone()
    want[1::2, 3:3 + 2 * vocab:2] = expected(view, mask, rows)
    base = base.to(path)
    apply_token_bitmask(base[1::2, 3:3 + 2 * vocab:2], mask.to(path), rows.to(path))
    assert_bits_equal(base, want)


def test_an_all_ones_mask_changes_nothing_and_all_zeros_masks_everything(path):
    x = randn((2, 70), torch.float32, path, 3)
    before = x.clone()
    apply_token_bitmask(x, tb.allocate_token_bitmask(2, 70, path))
    assert torch.equal(x, before)
    apply_token_bitmask(x, torch.zeros(1, 3, dtype=torch.int32, device=path), torch.tensor([1], device=path))
    assert torch.equal(x[0], before[0]) and bool((x[1] == float("-inf")).all())


@pytest.mark.parametrize("rows", [None, [4, 0, 2]])
def test_bytes_moved_is_the_mask_and_one_pass_over_its_rows(rows):
    """Against the nbytes of the mask, the row numbers and each masked logits row (the write pass)."""
    vocab, dtype = 1000 + 7, torch.bfloat16
    x = randn((5, vocab), dtype, "cpu", 6)
    idx = None if rows is None else torch.tensor(rows)
    targets = range(5) if rows is None else rows
    mask = random_bitmask(len(targets), vocab, 7)
    expected = mask.nbytes + (0 if idx is None else idx.nbytes) + sum(x[r].nbytes for r in targets)
    assert tb.bytes_moved(len(targets), vocab, x.element_size(), 0 if idx is None else idx.element_size()) == expected


def test_no_mask_rows_is_a_no_op(path):
    x = randn((3, 64), torch.bfloat16, path, 4)
    before = x.clone()
    apply_token_bitmask(x, torch.empty(0, 2, dtype=torch.int32, device=path),
                        torch.empty(0, dtype=torch.int64, device=path))
    assert torch.equal(x, before)


def test_agrees_with_xgrammar_on_cpu():
    xgr = pytest.importorskip("xgrammar")
    vocab, batch, rows = 49152 + 7, 4, [3, 0]
    for dtype in (torch.float32, torch.bfloat16):
        x = logits_with_nans((batch, vocab), dtype, 11)
        mask = random_bitmask(len(rows), vocab, 12)
        full = tb.allocate_token_bitmask(batch, vocab)
        full[rows] = mask  # xgrammar's indices pick the same row of logits and of the bitmask
        theirs = x.clone()
        xgr.apply_token_bitmask_inplace(theirs, full, indices=rows, backend="cpu")
        ours = apply_token_bitmask(x.clone(), mask, torch.tensor(rows))
        assert torch.equal(ours.view(BITS[dtype]), theirs.view(BITS[dtype]))


@pytest.mark.parametrize("make, error, pattern", [
    (lambda: (torch.ones(2, 40, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32), None), TypeError,
     "logits must have dtype"),
    (lambda: (torch.ones(40), torch.zeros(1, 2, dtype=torch.int32), None), ValueError, "logits must be 2-D"),
    (lambda: (torch.ones(2, 40), torch.zeros(2, 2, dtype=torch.int64), None), TypeError, "bitmask must have dtype"),
    (lambda: (torch.ones(2, 40), torch.zeros(2, 1, dtype=torch.int32), None), ValueError,
     r"bitmask must have ceil\(vocab / 32\) = 2"),
    (lambda: (torch.ones(2, 33), torch.zeros(2, 4, dtype=torch.int32)[:, ::2], None), ValueError,
     "bitmask must be contiguous"),
    (lambda: (torch.ones(3, 40), torch.zeros(2, 2, dtype=torch.int32), None), ValueError,
     "without rows, bitmask must have one row per logits row"),
    (lambda: (torch.ones(3, 40), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0, 3])), ValueError,
     r"rows must be logits row numbers in \[0, 3\), got 3"),
    (lambda: (torch.ones(3, 40), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([-1, 0])), ValueError,
     "rows must be logits row numbers"),
    (lambda: (torch.ones(3, 40), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0])), ValueError,
     "rows must hold one logits row number per bitmask row"),
    (lambda: (torch.ones(3, 40), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0.0])), TypeError,
     "rows must have dtype"),
])
def test_bad_input_names_the_argument(make, error, pattern):
    logits, mask, rows = make()
    with pytest.raises(error, match=pattern):
        apply_token_bitmask(logits, mask, rows)


@pytest.mark.gpu
def test_bad_device_names_the_argument():
    with pytest.raises(ValueError, match="bitmask is on cpu but logits is on cuda"):
        apply_token_bitmask(torch.ones(2, 40, device="cuda"), torch.zeros(2, 2, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [151936, 262144 + 3])
def test_gpu_large_batches(vocab):
    x = logits_with_nans((64, vocab), torch.bfloat16, vocab)
    rows = torch.randperm(64, generator=generator(1))[:40]
    mask = random_bitmask(40, vocab, 2)
    got = apply_token_bitmask(x.cuda(), mask.cuda(), rows.cuda())
    assert_bits_equal(got, expected(x, mask, rows))


@pytest.mark.gpu
def test_gpu_under_cuda_graph():
    # No host read-back on CUDA (validate defaults to off there), so the op can live inside a decode graph.
    vocab = 49152
    x = logits_with_nans((8, vocab), torch.float32, 7).cuda()
    mask, rows = random_bitmask(3, vocab, 8).cuda(), torch.tensor([6, 1, 4], device="cuda")
    buffer = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        apply_token_bitmask(buffer, mask, rows)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_token_bitmask(buffer, mask, rows)
    buffer.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert_bits_equal(buffer, expected(x.cpu(), mask.cpu(), rows.cpu()))


# --- generated code ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled():
    return compile_module("kernel_lab.ops.token_bitmask", targets=TARGETS)


def test_compiles_for_every_target_without_spills(compiled):
    names = check_no_spills(compiled)
    assert {"token_bitmask_bf16", "token_bitmask_fp32_rows"} <= names


def test_sass_writes_without_reading_the_logits(compiled):
    for (name, target), result in compiled.items():
        sass = result["sass"]
        # predicated -inf stores only: the loads are the mask words (32-bit) and the row number (64-bit);
        # a logits load would show 16-bit or 128-bit loads, or many more 32-bit ones (16 elements per thread)
        assert "STG" in sass, (name, target)
        assert not re.search(r"LDG\.E\.(128|U16)", sass) and len(re.findall(r"\bLDG", sass)) <= 6, (name, target)
