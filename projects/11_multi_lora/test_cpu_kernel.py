"""csrc/cpu/lora.c, the CPU path of add_lora in float32 and the LoRA step of decode_stack.c, on each ISA build
(native, AVX2 forced, scalar forced): against the float64 reference with odd widths and ranks, gaps and base
rows in the map, B in both layouts ([L, N, R] and the engine's [L, R, N] storage); base rows keep their bits;
and a row's result is the same bits whatever else is in the batch, however many threads split it and
whichever layout B has (the property the engine's batch invariance and speculative decoding lean on)."""

from __future__ import annotations

import pytest
import torch

from kernel_lab.harness.testing import ISA_BUILDS, assert_close, randn
from kernel_lab.ops.lora import add_lora, add_lora_cpu, lora_reference

MAP = [0, 2, -1, 4, 4, 0, -1, 2, 2, 0, 4, -1, 2]   # adapters 1 and 3 unused, base rows between


@pytest.fixture(params=ISA_BUILDS, scope="module")
def lib(request, isa_build):
    return isa_build("lora", request.param)


def offsets_of(widths):
    out = [0]
    for w in widths:
        out.append(out[-1] + w)
    return tuple(out)


def case(widths, rank, k, adapters, rows, seed, b_layout):
    lora_a = randn((adapters, len(widths), rank, k), torch.float32, "cpu", seed, scale=k ** -0.5)
    lora_b = randn((adapters, sum(widths), rank), torch.float32, "cpu", seed + 1, scale=rank ** -0.5)
    if b_layout == "r_n":   # the engine's CPU slots: [L, R, N] storage seen as [L, N, R]
        lora_b = lora_b.transpose(1, 2).contiguous().transpose(1, 2)
    scale = torch.rand(adapters, generator=torch.Generator().manual_seed(seed + 2)) + 0.5
    x = randn((rows, k), torch.float32, "cpu", seed + 3)
    y = randn((rows, sum(widths)), torch.float32, "cpu", seed + 4)
    return x, y, lora_a, lora_b, scale


@pytest.mark.parametrize("b_layout", ["n_r", "r_n"])
@pytest.mark.parametrize("widths,rank,k", [((20, 12, 12), 13, 45), ((96, 32, 32), 16, 96), ((37,), 64, 131),
                                           ((300, 300), 8, 70)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_the_float64_reference(lib, b_layout, widths, rank, k, threads):
    rows = torch.tensor(MAP, dtype=torch.int32)
    x, y, lora_a, lora_b, scale = case(widths, rank, k, 5, len(MAP), 11, b_layout)
    before = y.clone()
    expected = lora_reference(before.double(), x.double(), lora_a.double(), lora_b.double(), scale.double(),
                              offsets_of(widths), rows)
    assert add_lora_cpu(y, x, lora_a, lora_b, scale, offsets_of(widths), rows, None, threads=threads, library=lib)
    base = rows < 0
    assert torch.equal(y[base].view(torch.int32), before[base].view(torch.int32)), "a base row was written"
    assert_close(y[~base], expected[~base], torch.float32)


@pytest.mark.parametrize("b_layout", ["n_r", "r_n"])
@pytest.mark.parametrize("widths,rank,k", [((20, 12, 12), 13, 45), ((128, 64), 16, 96), ((37,), 64, 131)])
@pytest.mark.parametrize("threads", [1, 2])
def test_bfloat16_slots_give_the_bits_of_float32_slots_holding_the_same_values(lib, b_layout, widths, rank, k,
                                                                               threads):
    """--lora-dtype bfloat16: the kernel widens each weight exactly, so bfloat16 A and B give the same bits as
    float32 A and B rounded to bfloat16 (64-column register blocks and the generic tail both), and the float64
    reference of those values within float32's tolerance."""
    rows = torch.tensor(MAP, dtype=torch.int32)
    x, y, lora_a, lora_b, scale = case(widths, rank, k, 5, len(MAP), 17, b_layout)
    a16, b16 = lora_a.to(torch.bfloat16), lora_b.to(torch.bfloat16)
    a32, b32 = a16.float(), b16.float()
    if b_layout == "r_n":
        b16, b32 = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (b16, b32))
    assert not torch.equal(a32, lora_a), "the case must hold values bfloat16 rounds"
    narrow, wide = y.clone(), y.clone()
    assert add_lora_cpu(narrow, x, a16, b16, scale, offsets_of(widths), rows, None, threads=threads, library=lib)
    assert add_lora_cpu(wide, x, a32, b32, scale, offsets_of(widths), rows, None, threads=threads, library=lib)
    assert torch.equal(narrow.view(torch.int32), wide.view(torch.int32))
    expected = lora_reference(y.double(), x.double(), a32.double(), b32.double(), scale.double(),
                              offsets_of(widths), rows)
    assert_close(narrow[rows >= 0], expected[rows >= 0], torch.float32)


def test_add_lora_takes_bfloat16_weights_under_float32_activations_on_cpu_only():
    """The public op: bfloat16 A/B beside float32 x run the C kernel (under the interpreter too: the Triton
    kernels read weights in x's dtype); bfloat16 A with float16 B is refused by name where they enter."""
    rows = torch.tensor(MAP, dtype=torch.int32)
    x, y, lora_a, lora_b, scale = case((20, 12), 8, 33, 5, len(MAP), 23, "n_r")
    expected = y.clone()
    assert add_lora_cpu(expected, x, lora_a.bfloat16().float(), lora_b.bfloat16().float(), scale,
                        offsets_of((20, 12)), rows, None)
    add_lora(y, x, lora_a.bfloat16(), lora_b.bfloat16(), scale, offsets_of((20, 12)), row_adapters=rows)
    assert torch.equal(y, expected)
    with pytest.raises((TypeError, ValueError), match="lora_b"):
        add_lora(y, x, lora_a.bfloat16(), lora_b.half(), scale, offsets_of((20, 12)), row_adapters=rows)


@pytest.mark.parametrize("b_layout", ["n_r", "r_n"])
def test_a_rows_bits_do_not_depend_on_the_batch_threads_or_layout(lib, b_layout):
    """The engine's shapes (SmolLM2's q|k|v: 576 | 192 | 192 over 576, rank 16), 4 adapters, 9 rows."""
    widths, offsets = (576, 192, 192), offsets_of((576, 192, 192))
    rows = torch.tensor([3, 0, -1, 1, 2, 0, 3, 3, 1], dtype=torch.int32)
    x, y0, lora_a, lora_b, scale = case(widths, 16, 576, 4, len(rows), 21, b_layout)
    other_b = lora_b.contiguous() if b_layout == "r_n" else lora_b.transpose(1, 2).contiguous().transpose(1, 2)
    results = []
    for threads, b in ((1, lora_b), (2, lora_b), (3, lora_b), (2, other_b)):
        y = y0.clone()
        add_lora_cpu(y, x, lora_a, b, scale, offsets, rows, None, threads=threads, library=lib)
        results.append(y)
    alone = y0.clone()
    for t in range(len(rows)):   # each row in a batch of one
        add_lora_cpu(alone[t:t + 1], x[t:t + 1], lora_a, lora_b, scale, offsets, rows[t:t + 1], None, threads=2,
                     library=lib)
    results.append(alone)
    for got in results[1:]:
        assert torch.equal(got.view(torch.int32), results[0].view(torch.int32)), (got - results[0]).abs().max()


def test_no_adapted_row_and_no_rows_leave_y_alone(lib):
    x, y, lora_a, lora_b, scale = case((20, 12, 12), 8, 45, 3, 4, 31, "r_n")
    before = y.clone()
    add_lora_cpu(y, x, lora_a, lora_b, scale, offsets_of((20, 12, 12)), torch.full((4,), -1, dtype=torch.int32),
                 None, library=lib)
    assert torch.equal(y.view(torch.int32), before.view(torch.int32))
    empty = torch.empty((0, 44))
    add_lora_cpu(empty, x[:0], lora_a, lora_b, scale, offsets_of((20, 12, 12)), torch.empty(0, dtype=torch.int32),
                 None, library=lib)


def test_bad_sizes_are_refused_by_status(lib):
    x, y, lora_a, lora_b, scale = case((20, 12, 12), 8, 45, 3, 4, 41, "n_r")
    with pytest.raises(RuntimeError, match="status -1"):   # offsets ending short of y's width
        add_lora_cpu(y, x, lora_a, lora_b, scale, (0, 20, 32, 40), torch.zeros(4, dtype=torch.int32), None,
                     library=lib)


def test_the_torch_fallback_reads_the_engines_layout(monkeypatch):
    """KERNEL_LAB_CPU_KERNELS=0 (no compiler): add_lora's torch path on [L, R, N] storage."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("KERNEL_LAB_CPU_KERNELS", "0")
    rows = torch.tensor(MAP, dtype=torch.int32)
    x, y, lora_a, lora_b, scale = case((20, 12, 12), 13, 45, 5, len(MAP), 51, "r_n")
    expected = lora_reference(y.double(), x.double(), lora_a.double(), lora_b.double(), scale.double(),
                              offsets_of((20, 12, 12)), rows)
    add_lora(y, x, lora_a, lora_b, scale, offsets_of((20, 12, 12)), row_adapters=rows)
    assert_close(y[rows >= 0], expected[rows >= 0], torch.float32)
