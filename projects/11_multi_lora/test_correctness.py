"""Project 11 correctness: batched LoRA (BGMV and SGMV, shrink and expand) vs a float64 per-row reference.

Every path runs here: the Triton kernels (compiled on a GPU, through the interpreter on CPU, see conftest.py)
and the CPU paths, with TRITON_INTERPRET unset at call time: `path="cpu"` (add_lora in float32 runs
csrc/cpu/lora.c, the rest torch) and `path="cpu-torch"` (KERNEL_LAB_CPU_KERNELS=0: torch everywhere, the
fallback where no C compiler exists). test_cpu_kernel.py tests the C kernel's own builds and bits.
Rows of the base model (-1) and rows in no segment must keep y's bits exactly; h is NaN-poisoned before shrink
and must stay NaN on those rows.
"""

import pytest
import torch

from kernel_lab.harness.compile import TARGETS, check_no_spills, compile_module
from kernel_lab.harness.testing import assert_close, case_seed, empty_poisoned, randn
from kernel_lab.ops.lora import (
    Segments,
    add_lora,
    bytes_moved,
    lora_expand,
    lora_reference,
    lora_shrink,
    rows_to_adapters,
    segments_of_runs,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
RANKS = [8, 16, 32, 64, 13]  # 13: a stored rank that is no power of two (the kernels mask the padding)
K = 45  # x's width: no power of two, and not a multiple of the kernel's 64-wide K tile
WIDTHS = (20, 12, 12)  # q|k|v-like slices of y, none a power of two
NUM_ADAPTERS = 5
# BGMV: adapters 1 and 3 unused (gaps in the map), base rows (-1) between them
ROW_ADAPTERS = [0, 2, -1, 4, 4, 0, -1, 2, 2, 0, 4, -1]
# SGMV: (start, length, adapter): segments of length 1, adapter 2 in two segments, a base-model segment,
# rows 7 and 12 in no segment at all, and the segments not listed in row order
SEGMENTS = [(8, 4, 2), (0, 1, 4), (13, 2, 1), (4, 1, 0), (1, 3, 2), (5, 2, -1)]
SEGMENT_ROWS = 15


@pytest.fixture(params=["kernel", "cpu", "cpu-torch"])
def path(request, monkeypatch):
    """The device of this path's tensors; "cpu" also switches the interpreter off for the call, and
    "cpu-torch" the C kernels."""
    if request.param.startswith("cpu"):
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        if request.param == "cpu-torch":
            monkeypatch.setenv("KERNEL_LAB_CPU_KERNELS", "0")
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def offsets_of(widths):
    out = [0]
    for w in widths:
        out.append(out[-1] + w)
    return tuple(out)


def make_weights(rank, dtype, device, seed, widths=WIDTHS, adapters=NUM_ADAPTERS, k=K):
    lora_a = randn((adapters, len(widths), rank, k), dtype, device, seed, scale=k ** -0.5)
    lora_b = randn((adapters, sum(widths), rank), dtype, device, seed + 1, scale=rank ** -0.5)
    scale = (torch.rand(adapters, generator=torch.Generator().manual_seed(seed + 2)) + 0.5).to(device)
    return lora_a, lora_b, scale


def make_layout(layout, device):
    if layout == "bgmv":
        rows = torch.tensor(ROW_ADAPTERS, dtype=torch.int32, device=device)
        return {"row_adapters": rows}, rows.cpu()
    starts, lengths, adapters = (torch.tensor(c, dtype=torch.int32, device=device) for c in zip(*SEGMENTS))
    segments = Segments(starts, lengths, adapters, max(s[1] for s in SEGMENTS))
    return {"segments": segments}, rows_to_adapters(segments, SEGMENT_ROWS)


def base_output(per_row, width, dtype, device, seed):
    """y before the call: finite random values everywhere, so any delta added to a row the call must leave
    alone changes its bits (a NaN there would absorb the write and hide it)."""
    return randn((per_row.shape[0], width), dtype, device, seed)


def bits(t):
    return t.cpu().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def check(y_after, y_before, expected64, per_row, dtype, msg=""):
    adapted = per_row >= 0
    assert torch.equal(bits(y_after)[~adapted], bits(y_before)[~adapted]), f"{msg} touched a base/unlisted row"
    scale = 1.0 if dtype == torch.float32 else 2.0  # half weights: h also rounds once to the weight dtype
    assert_close(y_after.cpu()[adapted], expected64[adapted], dtype, scale=scale, msg=msg)


# --- the whole projection -----------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["bgmv", "sgmv"])
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_lora_matches_float64_reference(path, layout, rank, dtype):
    seed = case_seed("add", layout, rank, dtype)
    lora_a, lora_b, scale = make_weights(rank, dtype, path, seed)
    kwargs, per_row = make_layout(layout, path)
    x = randn((per_row.shape[0], K), dtype, path, seed + 3)
    y = base_output(per_row, sum(WIDTHS), dtype, path, seed + 4)
    before = y.clone()
    expected = lora_reference(before, x, lora_a, lora_b, scale, offsets_of(WIDTHS), per_row)
    out = add_lora(y, x, lora_a, lora_b, scale, offsets_of(WIDTHS), **kwargs)
    assert out is y  # in place
    check(y, before, expected, per_row, dtype, f"{layout} r={rank}")


@pytest.mark.parametrize("layout", ["bgmv", "sgmv"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shrink_writes_only_adapted_rows(path, layout, dtype):
    seed = case_seed("shrink", layout, dtype)
    lora_a, _, _ = make_weights(16, dtype, path, seed)
    kwargs, per_row = make_layout(layout, path)
    x = randn((per_row.shape[0], K), dtype, path, seed + 3)
    h = empty_poisoned((per_row.shape[0], len(WIDTHS) * 16), torch.float32, path)
    assert lora_shrink(x, lora_a, out=h, **kwargs) is h
    adapted = per_row >= 0
    assert torch.isnan(h.cpu()[~adapted]).all(), "shrink wrote a base/unlisted row"
    expected = torch.einsum("tk,tsrk->tsr", x.double().cpu()[adapted],
                            lora_a.double().cpu()[per_row[adapted]]).reshape(int(adapted.sum()), -1)
    assert_close(h.cpu()[adapted], expected, torch.float32)  # products of half inputs are exact in fp32


@pytest.mark.parametrize("layout", ["bgmv", "sgmv"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_adds_scaled_slices_in_place(path, layout, dtype):
    seed = case_seed("expand", layout, dtype)
    _, lora_b, scale = make_weights(32, dtype, path, seed)
    kwargs, per_row = make_layout(layout, path)
    h = randn((per_row.shape[0], len(WIDTHS) * 32), torch.float32, path, seed + 3)
    y = base_output(per_row, sum(WIDTHS), dtype, path, seed + 4)
    before = y.clone()
    expected = before.double().cpu().clone()
    adapted = per_row >= 0
    offs = offsets_of(WIDTHS)
    for s in range(len(WIDTHS)):
        hs = h.double().cpu()[adapted, s * 32:(s + 1) * 32]
        bs = lora_b.double().cpu()[per_row[adapted], offs[s]:offs[s + 1]]
        expected[adapted, offs[s]:offs[s + 1]] += scale.double().cpu()[per_row[adapted], None] * torch.einsum(
            "tr,tnr->tn", hs, bs)
    lora_expand(y, h, lora_b, scale, offs, **kwargs)
    check(y, before, expected, per_row, dtype, f"expand {layout}")


@pytest.mark.parametrize("rows", [1, 20, 70])  # 20 and 70: SGMV's 64-row blocks, 70 spans two of them
@pytest.mark.parametrize("layout", ["bgmv", "sgmv"])
def test_all_rows_on_one_adapter(path, layout, rows):
    dtype = torch.float16
    seed = case_seed("one", layout, rows)
    lora_a, lora_b, scale = make_weights(16, dtype, path, seed)
    per_row = torch.full((rows,), 3, dtype=torch.int32)
    kwargs = {"row_adapters": per_row.to(path)} if layout == "bgmv" else {"segments": segments_of_runs(per_row.to(path))}
    x = randn((rows, K), dtype, path, seed + 3)
    y = randn((rows, sum(WIDTHS)), dtype, path, seed + 4)
    before = y.clone()
    expected = lora_reference(before, x, lora_a, lora_b, scale, offsets_of(WIDTHS), per_row)
    add_lora(y, x, lora_a, lora_b, scale, offsets_of(WIDTHS), **kwargs)
    check(y, before, expected, per_row.long(), dtype, f"{layout} rows={rows}")


def test_a_row_map_refilled_in_place_is_grouped_again(monkeypatch):
    """The CPU path groups a row map once and reuses it while the map's values stay the same: a static
    buffer refilled in place (the padded decode batch's) must be grouped again."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("KERNEL_LAB_CPU_KERNELS", "0")   # the torch path groups; the C kernel sorts per call
    lora_a, lora_b, scale = make_weights(16, torch.float32, "cpu", 5)
    rows = torch.tensor(ROW_ADAPTERS, dtype=torch.int32)
    x = randn((rows.shape[0], K), torch.float32, "cpu", 6)
    for refill in (None, [4, -1, 0, 0, 2, 2, 4, -1, 0, 2, 2, 4], None):
        if refill is not None:
            rows.copy_(torch.tensor(refill, dtype=torch.int32))
        y = base_output(rows, sum(WIDTHS), torch.float32, "cpu", 7)
        before = y.clone()
        expected = lora_reference(before, x, lora_a, lora_b, scale, offsets_of(WIDTHS), rows.clone())
        add_lora(y, x, lora_a, lora_b, scale, offsets_of(WIDTHS), row_adapters=rows)
        check(y, before, expected, rows.clone(), torch.float32, f"map {rows.tolist()}")


@pytest.mark.parametrize("layout", ["bgmv", "sgmv"])
def test_int64_indices(path, layout):
    seed = case_seed("int64", layout)
    lora_a, lora_b, scale = make_weights(8, torch.float32, path, seed)
    kwargs, per_row = make_layout(layout, path)
    if layout == "bgmv":
        kwargs = {"row_adapters": kwargs["row_adapters"].long()}
    else:
        seg = kwargs["segments"]
        kwargs = {"segments": Segments(seg.starts.long(), seg.lengths.long(), seg.adapters.long(), seg.max_length)}
    x = randn((per_row.shape[0], K), torch.float32, path, seed + 3)
    y = base_output(per_row, sum(WIDTHS), torch.float32, path, seed + 4)
    before = y.clone()
    expected = lora_reference(before, x, lora_a, lora_b, scale, offsets_of(WIDTHS), per_row)
    add_lora(y, x, lora_a, lora_b, scale, offsets_of(WIDTHS), **kwargs)
    check(y, before, expected, per_row, torch.float32, f"int64 {layout}")


def test_empty_batch_and_all_base_rows_leave_y_alone(path):
    lora_a, lora_b, scale = make_weights(8, torch.float32, path, 7)
    for rows, fill in ((0, -1), (6, -1)):
        per_row = torch.full((rows,), fill, dtype=torch.int32, device=path)
        x = randn((rows, K), torch.float32, path, 8)
        y = randn((rows, sum(WIDTHS)), torch.float32, path, 9)
        before = y.clone()
        add_lora(y, x, lora_a, lora_b, scale, offsets_of(WIDTHS), row_adapters=per_row)
        assert torch.equal(bits(y), bits(before))


def test_ragged_ranks_padded_with_zeros(path):
    """Adapters of ranks 8, 16, 32, 64 and 13 in one stack of rank 64: each must give its own rank's LoRA."""
    dtype, ranks = torch.bfloat16, (8, 16, 32, 64, 13)
    seed = case_seed("ragged")
    lora_a, lora_b, scale = make_weights(64, dtype, path, seed)
    for adapter, rank in enumerate(ranks):
        lora_a[adapter, :, rank:] = 0
        lora_b[adapter, :, rank:] = 0
    kwargs, per_row = make_layout("bgmv", path)
    x = randn((per_row.shape[0], K), dtype, path, seed + 3)
    y = base_output(per_row, sum(WIDTHS), dtype, path, seed + 4)
    before = y.clone()
    expected = before.double().cpu().clone()
    offs = offsets_of(WIDTHS)
    for t, adapter in enumerate(per_row.tolist()):  # each adapter's unpadded weights only
        if adapter < 0:
            continue
        rank = ranks[adapter]
        for s in range(len(WIDTHS)):
            h = lora_a[adapter, s, :rank].double().cpu() @ x[t].double().cpu()
            expected[t, offs[s]:offs[s + 1]] += float(scale[adapter]) * (
                lora_b[adapter, offs[s]:offs[s + 1], :rank].double().cpu() @ h)
    add_lora(y, x, lora_a, lora_b, scale, offs, **kwargs)
    check(y, before, expected, per_row, dtype, "ragged ranks")


@pytest.mark.parametrize("layout", ["bgmv", "sgmv"])
def test_stacked_slices_use_their_own_weights(path, layout):
    """Each slice reads its own A and B: with adapter 2's k slice absent (zero B), rows on adapter 2 keep
    their k columns bit-equal, and swapping two slices' A changes exactly those slices' outputs."""
    dtype = torch.float32
    seed = case_seed("slices", layout)
    lora_a, lora_b, scale = make_weights(16, dtype, path, seed)
    offs = offsets_of(WIDTHS)
    lora_b[2, offs[1]:offs[2]] = 0
    kwargs, per_row = make_layout(layout, path)
    x = randn((per_row.shape[0], K), dtype, path, seed + 3)
    y = base_output(per_row, sum(WIDTHS), dtype, path, seed + 4)
    before = y.clone()
    expected = lora_reference(before, x, lora_a, lora_b, scale, offs, per_row)
    add_lora(y, x, lora_a, lora_b, scale, offs, **kwargs)
    check(y, before, expected, per_row, dtype, "slices")
    on_two = per_row == 2
    assert torch.equal(bits(y)[on_two, offs[1]:offs[2]], bits(before)[on_two, offs[1]:offs[2]])
    swapped = lora_a[:, [1, 0, 2]].contiguous()
    y2 = before.clone()
    add_lora(y2, x, swapped, lora_b, scale, offs, **kwargs)
    adapted_q = (per_row >= 0)
    assert not torch.allclose(y2.cpu()[adapted_q, :offs[1]], y.cpu()[adapted_q, :offs[1]])
    assert torch.equal(bits(y2)[:, offs[2]:], bits(y)[:, offs[2]:])


# --- the layouts and the traffic model ----------------------------------------------------------------
def test_segments_of_runs():
    seg = segments_of_runs(torch.tensor([2, 2, -1, 0, 0, 0, 2], dtype=torch.int32))
    assert seg.starts.tolist() == [0, 2, 3, 6] and seg.lengths.tolist() == [2, 1, 3, 1]
    assert seg.adapters.tolist() == [2, -1, 0, 2] and seg.max_length == 3
    assert rows_to_adapters(seg, 7).tolist() == [2, 2, -1, 0, 0, 0, 2]


def test_bytes_moved_reads_each_segments_weights_once():
    rows, segments, k, n, r, s, b = 32, 4, 4096, 6144, 16, 3, 2
    weights = segments * (s * r * k + n * r) * b
    activations = rows * k * b + 2 * rows * n * b + 2 * rows * s * r * 4
    assert bytes_moved(rows, segments, k, n, r, s, b) == weights + activations
    assert bytes_moved(rows, segments, k, n, r, s, b, "shrink") + bytes_moved(rows, segments, k, n, r, s, b,
                                                                              "expand") == weights + activations


# --- bad input ------------------------------------------------------------------------------------------
def _bad_calls():
    def args(**over):
        lora_a, lora_b, scale = make_weights(8, torch.float32, "cpu", 1)
        rows = torch.tensor(ROW_ADAPTERS, dtype=torch.int32)
        base = {"y": torch.zeros(len(ROW_ADAPTERS), sum(WIDTHS)), "x": torch.zeros(len(ROW_ADAPTERS), K),
                "lora_a": lora_a, "lora_b": lora_b, "scale": scale, "slice_offsets": offsets_of(WIDTHS),
                "row_adapters": rows}
        return base | over

    seg = Segments(torch.tensor([0, 2]), torch.tensor([3, 2]), torch.tensor([0, 1]), 3)
    return [
        (args(x=torch.zeros(len(ROW_ADAPTERS), K, dtype=torch.float16)), TypeError, "lora_a"),
        (args(x=torch.zeros(len(ROW_ADAPTERS), K + 1)), ValueError, "lora_a must have shape"),
        (args(row_adapters=torch.tensor([0, 9] + ROW_ADAPTERS[2:], dtype=torch.int32)), ValueError, "row_adapters"),
        (args(row_adapters=torch.tensor([-2] + ROW_ADAPTERS[1:])), ValueError, r"row_adapters.*\[-1, 5\)"),
        (args(row_adapters=torch.tensor(ROW_ADAPTERS[1:], dtype=torch.int32)), ValueError, "one entry per row"),
        (args(row_adapters=torch.tensor(ROW_ADAPTERS, dtype=torch.float32)), TypeError, "row_adapters"),
        (args(row_adapters=None), ValueError, "exactly one of row_adapters"),
        (args(row_adapters=None, segments=seg), ValueError, "overlap"),
        (args(row_adapters=None, segments=Segments(seg.starts, seg.lengths, seg.adapters, 2)), ValueError,
         "max_length"),
        (args(row_adapters=None, segments=Segments(torch.tensor([11]), torch.tensor([3]), torch.tensor([0]), 3)),
         ValueError, "within the 12 rows"),
        (args(slice_offsets=(0, 20, 44)), ValueError, "slice_offsets"),
        (args(slice_offsets=(0, 20, 20, 44)), ValueError, "slice_offsets"),
        (args(scale=torch.ones(4)), ValueError, "scale"),
        (args(scale=torch.ones(5, dtype=torch.float64)), TypeError, "scale"),
        (args(y=torch.zeros(len(ROW_ADAPTERS), sum(WIDTHS) + 1)), ValueError, "lora_b must have shape"),
        (args(y=torch.zeros(3, sum(WIDTHS))), ValueError, "y must have x's"),
        (args(y=torch.zeros(sum(WIDTHS), len(ROW_ADAPTERS)).t()), ValueError, "y is updated in place"),
        (args(lora_b=torch.zeros(NUM_ADAPTERS, sum(WIDTHS), 16)), ValueError, "lora_b must hold"),
    ]


@pytest.mark.parametrize("call,error,match", _bad_calls())
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        add_lora(**call)


def test_shrink_out_must_fit():
    lora_a, _, _ = make_weights(8, torch.float32, "cpu", 1)
    x = torch.zeros(4, K)
    rows = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="out must be a float32"):
        lora_shrink(x, lora_a, row_adapters=rows, out=torch.zeros(4, 8))
    with pytest.raises(TypeError, match="out"):
        lora_shrink(x, lora_a, row_adapters=rows, out=torch.zeros(4, 24, dtype=torch.float16))


# --- the GPU at model sizes, and the AOT builds -----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bgmv", "sgmv"])
def test_model_sized_qkv_on_the_gpu(layout):
    dtype, widths, k, rank = torch.bfloat16, (4096, 1024, 1024), 4096, 16
    lora_a, lora_b, scale = make_weights(rank, dtype, "cuda", 11, widths=widths, adapters=8, k=k)
    per_row = torch.tensor([i % 9 - 1 for i in range(64)], dtype=torch.int32)
    if layout == "sgmv":
        per_row = torch.sort(per_row).values
    kwargs = ({"row_adapters": per_row.cuda()} if layout == "bgmv" else {"segments": segments_of_runs(per_row.cuda())})
    x = randn((64, k), dtype, "cuda", 12)
    y = base_output(per_row.long(), sum(widths), dtype, "cuda", 13)
    before = y.clone()
    expected = lora_reference(before, x, lora_a, lora_b, scale, offsets_of(widths), per_row)
    add_lora(y, x, lora_a, lora_b, scale, offsets_of(widths), **kwargs)
    check(y, before, expected, per_row.long(), dtype, f"gpu {layout}")


@pytest.fixture(scope="module")
def compiled():
    return compile_module("kernel_lab.ops.lora", targets=TARGETS)


def test_compiles_for_every_target_without_spills(compiled):
    names = check_no_spills(compiled)
    assert {n.split("_")[1] for n in names} == {"shrink", "expand"}
    for (name, target), result in compiled.items():
        if "fp32" not in name:  # half dots run on tensor cores (fp32 IEEE dots are FMAs by design)
            assert "HMMA" in result["sass"] or "HGMMA" in result["sass"], (name, target)
