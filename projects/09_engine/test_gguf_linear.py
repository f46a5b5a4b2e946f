"""The quantized CPU linear layer (kernel_lab/ops/gguf_linear.py, kernel_lab/csrc/cpu/gguf_linear.c and
gguf_kquant_tiles.h), for Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K.

- The C kernel against `gguf_linear_reference` (the same int8 activations, exact integer block dots, float64
  scales): equal up to float32 summation, for every format, odd shapes, strided inputs, poisoned outputs.
- Against float64 x @ W.T on the dequantized weights, within the bound the activation rounding implies:
  |error| <= sum over blocks of (amax_block(x) / 254) * sum_block |W| (plus float32 summation). The bound is
  the same for every format, K-quants included: their weights enter exactly (the kernel splits each 32-block
  into d sc q and dmin m, or d sc (q - 32), in exact integer and float products), and x is rounded per 32 as
  for the others. The K-quant decoding (and so W) is checked against the gguf package's dequantizers.
- Every ISA variant this CPU can run (AVX-512 VNNI, AVX-VNNI, AVX2, scalar C) built and compared, and the
  default build holds the instructions its path relies on.
- The thread pool splits rows without changing a bit, call after call; the 8-row packing is lossless; the
  block decoding matches the gguf package's own; bad inputs raise errors that name the argument.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess

import pytest
import torch

from kernel_lab.harness.testing import case_seed, generator, poison
from kernel_lab.ops import cpu_kernels
from kernel_lab.ops import gguf_linear as gguf_linear_module
from kernel_lab.ops.gguf_linear import (
    BLOCK,
    BLOCK_BYTES,
    BLOCK_WEIGHTS,
    FORMATS,
    GGML_Q4_1,
    GGML_Q4_K,
    GGML_Q6_K,
    GGML_Q8_0,
    K_QUANTS,
    QuantizedWeight,
    _kquant_parts,
    dequantize_rows,
    gguf_linear,
    gguf_linear_reference,
    kernel_isa,
    pack,
    pack_stacked,
    quantize_activations,
    stack,
)

EPS32 = 2.0 ** -23
SHAPES = [  # (rows of x, out features, in features): tile edges (8), partial tiles, TILE_M edges (4)
    (1, 8, 32), (2, 7, 64), (3, 37, 96), (4, 264, 576), (5, 1, 32), (9, 129, 1536), (33, 40, 160),
]
BLOCK_FORMATS = sorted(f for f, t in FORMATS.items() if t not in K_QUANTS)  # 32-weight blocks
K_FORMATS = sorted(f for f, t in FORMATS.items() if t in K_QUANTS)


def width(fmt: str, k: int) -> int:
    """k rounded up to the format's block (K-quants: 256; so SHAPES give 256, 512, 768, 1536 for them)."""
    block = BLOCK_WEIGHTS[FORMATS[fmt]]
    return -(-k // block) * block


def random_weight(fmt: str, n: int, k: int, seed: int, fill: int | None = None) -> QuantizedWeight:
    """Every quant bit pattern occurs; scales are random fp16 of both signs (llama.cpp's Q4_0 and Q8_0
    scales are negative when a block's largest magnitude is negative), Q4_1 minimums likewise. K-quants:
    every 6-bit scale and min (Q4_K, Q5_K) and int8 scale (Q6_K) occurs; d and dmin are random fp16.
    `fill`: every byte but d/dmin/m is this value instead (0xFF: every quant at the format's largest)."""
    ggml_type, g = FORMATS[fmt], generator(seed)
    nb, bb = k // BLOCK_WEIGHTS[ggml_type], BLOCK_BYTES[ggml_type]
    data = torch.randint(0, 256, (n, nb, bb), dtype=torch.uint8, generator=g)
    if fill is not None:
        data.fill_(fill)
    sign = torch.where(torch.rand(n, nb, 1, generator=g) < 0.3, -1.0, 1.0)
    scale = 0.002 + 0.03 * torch.rand(n, nb, 1, generator=g)
    if ggml_type in K_QUANTS:
        scale = scale / 32  # the scales multiply it (up to 63, or 127 for Q6_K)
    d_at = 208 if ggml_type == GGML_Q6_K else 0
    data[..., d_at:d_at + 2] = (sign * scale).half().view(torch.uint8)
    if ggml_type == GGML_Q4_1:
        data[..., 2:4] = (0.2 * torch.rand(n, nb, 1, generator=g) - 0.15).half().view(torch.uint8)
    if ggml_type in (GGML_Q4_K, FORMATS["Q5_K"]):  # dmin
        data[..., 2:4] = (0.01 * torch.rand(n, nb, 1, generator=g) - 0.003).half().view(torch.uint8)
    return QuantizedWeight(ggml_type, data.view(n, nb * bb), (n, k))


def random_x(m: int, k: int, seed: int, strided: bool = False) -> torch.Tensor:
    g = generator(seed)
    x = torch.randn(m, k + 5 if strided else k, generator=g) * (1 + 3 * torch.rand(m, 1, generator=g))
    return x[:, 3:3 + k] if strided else x


def summation_tolerance(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """Float32 rounding allowance of the kernel's block sums: (blocks + 4) ulps of sum |terms|. The K-quants'
    terms are the two parts the kernel sums, d sc q x and dmin m s_x, each larger than w x can be."""
    if weight.ggml_type in K_QUANTS:
        scaled, mins = _kquant_parts(weight)
        sums = x.double().abs().reshape(x.shape[0], -1, BLOCK).sum(-1)           # >= |s_x| / 1.01
        magnitude = (x.double().abs() * 1.01) @ scaled.abs().T + (sums * 1.01) @ mins.abs().T
        return (weight.shape[1] // BLOCK + 4) * EPS32 * magnitude + 1e-30
    magnitude = (x.double().abs() * 1.01) @ weight.dequantize().double().abs().T
    return (weight.shape[1] // BLOCK + 4) * EPS32 * magnitude + 1e-30


def activation_rounding_bound(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """sum_b (amax_b / 254) * sum_{j in b} |W_nj|: the most int8 rounding of x (half a step, d / 2 with
    d = amax / 127, per element) can move each output."""
    m, k = x.shape
    half_step = x.double().reshape(m, k // BLOCK, BLOCK).abs().amax(-1) / 254.0          # [m, nb]
    w_abs = weight.dequantize().double().abs().reshape(weight.shape[0], k // BLOCK, BLOCK).sum(-1)  # [n, nb]
    return half_step @ w_abs.T


def run_kernel(lib, x: torch.Tensor, weight: QuantizedWeight, threads: int = 1) -> torch.Tensor:
    """One call of a given build of the library, into a poisoned output."""
    packed = pack(weight)
    n, k = weight.shape
    y = poison(torch.empty(x.shape[0], n))
    assert lib.kl_gguf_linear(weight.ggml_type, packed.tiles.data_ptr(), n, k, x.data_ptr(), x.shape[0],
                              x.stride(0), y.data_ptr(), y.stride(0), threads) == 0
    return y


@pytest.fixture(scope="module")
def library():
    if cpu_kernels.compiler() is None:
        pytest.skip("no C compiler ($CC or cc on PATH)")
    lib = cpu_kernels.load_library("gguf_linear")
    assert lib is not None, "a C compiler is on PATH but gguf_linear.c did not build"
    return lib


# ------------------------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_kernel_matches_the_exact_reference(library, fmt, m, n, k):
    k = width(fmt, k)
    seed = case_seed("gguf-exact", fmt, m, n, k)
    weight = random_weight(fmt, n, k, seed)
    x = random_x(m, k, seed + 1, strided=m % 2 == 1)
    out = poison(torch.empty(m, n))
    y = gguf_linear(x, pack(weight), out=out)
    assert y is out and torch.isfinite(y).all(), "an output element was left unwritten"
    error = (y.double() - gguf_linear_reference(x, weight)).abs()
    assert bool((error <= summation_tolerance(x, weight)).all()), f"max error {error.max():.3g}"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("m,n,k", SHAPES[2:5])
def test_kernel_vs_float64_on_the_dequantized_weights(library, fmt, m, n, k):
    """The stated per-format bound: activation rounding, and nothing else, separates the kernel from
    float64 x @ W.T on the very weights the blocks encode. The bound is not loose: the error reaches a
    visible fraction of it (a test that cannot fail is a defect)."""
    k = width(fmt, k)
    seed = case_seed("gguf-f64", fmt, m, n, k)
    weight = random_weight(fmt, n, k, seed)
    x = random_x(m, k, seed + 1)
    y = gguf_linear(x, weight, bias=(bias := torch.randn(n, generator=generator(seed + 2))))
    exact = x.double() @ weight.dequantize().double().T + bias.double()
    bound = activation_rounding_bound(x, weight) + summation_tolerance(x, weight) + 1e-6 * bias.double().abs()
    error = (y.double() - exact).abs()
    assert bool((error <= bound).all()), f"worst error / bound {(error / bound).max():.3g}"
    assert float((error / bound).max()) > 0.02, "the error is far below its bound: is x being quantized?"


def test_activation_rounding_matches_torch(library):
    """The C rounding of x to int8 blocks is bit-for-bit quantize_activations (ties to even included)."""
    x = random_x(6, 160, case_seed("gguf-act"))
    x[0, :32] = torch.arange(32) - 15.5              # halves that round to even
    x[1, 32:64] = 0.0                                 # an all-zero block: d = 0, q = 0
    q, d, s = (torch.empty(6, 160, dtype=torch.int8), torch.empty(6, 5), torch.empty(6, 5))
    library.kl_gguf_quantize_activations(x.data_ptr(), 6, 160, x.stride(0), q.data_ptr(), d.data_ptr(),
                                         s.data_ptr())
    q_ref, d_ref, s_ref = quantize_activations(x)
    assert torch.equal(q, q_ref) and torch.equal(d, d_ref) and torch.equal(s, s_ref)


def _isa_expected(flags: str) -> str:
    if " avx512_vnni " in flags and " avx512vl " in flags:
        return "avx512vnni"
    if " avx_vnni " in flags:
        return "avxvnni"
    if all(f" {f} " in flags for f in ("avx2", "fma", "f16c")):
        return "avx2"
    return "scalar"


# Narrower builds of the same source, each a path some CPU takes: (flags after -march=native, the path).
# The avx2 and scalar ones are the builds KERNEL_LAB_CPU_ISA selects for the engine (test_cpu_isa.py).
VARIANTS = [(("-mno-avx512f",), None), (cpu_kernels.ISA_FLAGS["avx2"], "avx2"), (cpu_kernels.ISA_FLAGS["scalar"], "scalar")]


@pytest.mark.parametrize("extra_flags,expected", VARIANTS, ids=["no-avx512", "no-vnni", "scalar"])
def test_every_isa_path_this_cpu_runs(library, extra_flags, expected):
    """Each narrower build computes the same products: compared with the exact reference, and with the
    default build (which may round the float sums in another order, so within the same tolerance)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the ISA variants are x86-64 builds")
    flags = f" {cpu_kernels._cpu_flags()} "
    lib = cpu_kernels.load_library("gguf_linear", extra_flags)
    assert lib is not None, f"the {extra_flags} build failed"
    isa = lib.kl_gguf_isa().decode()
    if expected is None:  # without AVX-512: VNNI only where the CPU has AVX-VNNI
        expected = _isa_expected(flags.replace(" avx512_vnni ", " "))
    if expected == "avx2" and _isa_expected(flags) == "scalar":
        expected = "scalar"
    assert isa == expected
    for fmt in sorted(FORMATS):
        seed = case_seed("gguf-isa", extra_flags, fmt)
        weight, x = random_weight(fmt, 37, width(fmt, 96), seed), random_x(5, width(fmt, 96), seed + 1)
        y = run_kernel(lib, x, weight)
        tol = summation_tolerance(x, weight)
        assert bool(((y.double() - gguf_linear_reference(x, weight)).abs() <= tol).all()), (isa, fmt)
        assert bool(((y - run_kernel(library, x, weight)).double().abs() <= 2 * tol).all()), (isa, fmt)
        # The integer sums at their extremes: every quant at its largest against activations that all
        # quantize to +127 or -127 (an int16 partial sum of AVX2's dot_groups that could overflow does
        # here). Q8_0 takes no int16 partial sums; its +128 bias cancels in float at these values, past
        # summation_tolerance's model, so it is left out.
        if fmt == "Q8_0":
            continue
        weight = random_weight(fmt, 37, width(fmt, 96), seed + 2, fill=0xFF)
        for sign in (1.0, -1.0):
            x = torch.full((3, width(fmt, 96)), sign)
            y = run_kernel(lib, x, weight)
            tol = summation_tolerance(x, weight)
            assert bool(((y.double() - gguf_linear_reference(x, weight)).abs() <= tol).all()), (isa, fmt, sign)


def test_tile_pairs_compute_the_same_bits_as_single_tiles(library):
    """With AVX-512 (VNNI and BW) steps take two tiles at once in 512-bit vectors, up to 8 rows a pass; each
    lane does the 256-bit path's operations in its order, so the bits match a build without the pair path,
    and a row's bits do not depend on how many rows share its step. The shapes cover pairs, a leftover single
    tile, a partial last tile, every pass width (1-8 rows) and row counts off the 8-row passes."""
    flags = f" {cpu_kernels._cpu_flags()} "
    if cpu_kernels.isa() != "native":
        pytest.skip(f"KERNEL_LAB_CPU_ISA={cpu_kernels.isa()}: the default build has no tile pairs")
    if not all(f" {f} " in flags for f in ("avx512_vnni", "avx512bw", "avx512vl")):
        pytest.skip("the pair path needs AVX-512 VNNI and BW")
    single = cpu_kernels.load_library("gguf_linear", ("-mno-avx512bw",))
    assert single is not None and single.kl_gguf_isa().decode() == "avx512vnni"
    for fmt in sorted(FORMATS):
        for m, n, k in [(1, 32, 64), (2, 24, 64), (3, 16, 96), (5, 16, 64), (7, 40, 64), (8, 24, 96), (9, 129, 96),
                        (33, 40, 160), (64, 264, 576)]:
            k = width(fmt, k)
            seed = case_seed("gguf-pairs", fmt, m, n, k)
            weight, x = random_weight(fmt, n, k, seed), random_x(m, k, seed + 1)
            paired = run_kernel(library, x, weight)
            assert torch.equal(paired, run_kernel(single, x, weight)), (fmt, m, n, k)
            for rows in (1, 4, 6):
                assert torch.equal(paired[:rows], run_kernel(library, x[:rows], weight)), (fmt, rows, "of", m)


def test_default_build_takes_the_widest_path_and_holds_its_instructions(library):
    """The library built for this CPU uses its best dot-product instruction: vpdpbusd (VNNI) or vpmaddubsw
    (AVX2). A silent fallback to the scalar loop would pass every maths test while running 10x slower."""
    if cpu_kernels.isa() != "native":
        pytest.skip(f"KERNEL_LAB_CPU_ISA={cpu_kernels.isa()} narrows the default build (test_cpu_isa.py checks it)")
    flags = f" {cpu_kernels._cpu_flags()} "
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the instruction check is written for x86-64")
    isa = kernel_isa()
    assert isa == _isa_expected(flags)
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) not on PATH")
    path = cpu_kernels.build(cpu_kernels.compiler(), cpu_kernels.GGUF_LINEAR_SOURCE)
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True,
                             check=True).stdout
    wanted = {"avx512vnni": r"\bvpdpbusd\b", "avxvnni": r"\bvpdpbusd\b", "avx2": r"\bvpmaddubsw\b"}.get(isa)
    if wanted:
        assert len(re.findall(wanted, listing)) >= 8, f"{isa} build without {wanted}"
    if isa == "avx512vnni" and " avx512bw " in flags:  # the 512-bit tile-pair path for many-row steps
        assert len(re.findall(r"\bvpdpbusd\b[^\n]*zmm", listing)) >= 8, "no 512-bit vpdpbusd"


def test_threads_split_rows_without_changing_a_bit(library):
    """Many calls with 1, 2 and 3 threads (the pool wakes, splits tiles, and sleeps between calls, including
    calls too small to split) give identical outputs."""
    for call in range(60):
        fmt = sorted(FORMATS)[call % len(FORMATS)]
        n, k = (264, 40, 1030)[call % 3], width(fmt, 64)
        seed = case_seed("gguf-threads", call)
        weight, x = random_weight(fmt, n, k, seed), random_x(1 + call % 6, k, seed + 1)
        packed = pack(weight)
        single = gguf_linear(x, packed, threads=1)
        assert torch.equal(gguf_linear(x, packed, threads=2 + call % 2), single), call


def test_packing_is_lossless_and_embedding_rows_decode(library):
    for fmt in sorted(FORMATS):
        weight = random_weight(fmt, 21, width(fmt, 96), case_seed("gguf-pack", fmt))
        packed = pack(weight)
        padded = 24 * weight.nbytes // 21  # 3 tiles of 8 rows; Q4_K/Q5_K widen their 6-bit scales to bytes
        widened = {"Q4_K": 1184 / 1152, "Q5_K": 1440 / 1408}.get(fmt, 1.0)
        assert packed.tiles.shape[0] == 3 and packed.nbytes == round(padded * widened)
        assert torch.equal(packed.tiles, pack(weight, use_kernel=False).tiles), "the C and torch packers differ"
        assert torch.equal(packed.unpack().data, weight.data)
        ids = torch.tensor([0, 20, 7, 8, 7])
        assert torch.equal(dequantize_rows(packed, ids), weight.dequantize()[ids])


def test_a_weight_of_several_huge_pages_is_packed_into_its_own_mapping_with_the_same_bytes(library):
    """A weight over two huge pages (here 4.7 MB of Q4_K) takes gguf_linear._tile_buffer's mapped path:
    its bytes are still the torch packer's and the kernel's output is the exact reference's; a small
    buffer takes torch.empty's path, of the asked size."""
    weight = random_weight("Q4_K", 4096, 2048, case_seed("gguf-pack-huge"))
    packed = pack(weight)
    assert packed.nbytes > 2 * gguf_linear_module._HUGE_PAGE
    assert torch.equal(packed.tiles, pack(weight, use_kernel=False).tiles)
    x = random_x(2, 2048, case_seed("gguf-pack-huge", "x"))
    y = gguf_linear(x, packed, out=poison(torch.empty(2, 4096)))
    error = (y.double() - gguf_linear_reference(x, weight)).abs()
    assert bool((error <= summation_tolerance(x, weight)).all()), f"max error {error.max():.3g}"
    small = gguf_linear_module._tile_buffer(1 << 20)
    assert small.numel() == 1 << 20 and small.dtype == torch.uint8


def test_a_stack_of_formats_computes_each_part_into_its_columns(library):
    """Q4_K_M's q|k|v with v in Q6_K: one PackedStack, whose output is each part's own output side by side
    (bit for bit), bias included, every column written."""
    seed = case_seed("gguf-stack")
    parts = [random_weight(fmt, n, 512, seed + i) for i, (fmt, n) in enumerate([("Q4_K", 24), ("Q4_K", 13),
                                                                                 ("Q6_K", 13)])]
    x, bias = random_x(5, 512, seed + 9), torch.randn(50, generator=generator(seed + 10))
    stacked = stack([pack(p) for p in parts])
    assert stacked.shape == (50, 512) and stacked.format == "Q4_K+Q4_K+Q6_K"
    assert stacked.nbytes == sum(pack(p).nbytes for p in parts)
    y = gguf_linear(x, stacked, bias=bias, out=poison(torch.empty(5, 50)))
    expected = torch.cat([gguf_linear(x, pack(p)) for p in parts], dim=1) + bias
    assert torch.equal(y, expected)
    with pytest.raises(ValueError, match="one width"):
        stack([pack(parts[0]), pack(random_weight("Q6_K", 8, 256, seed))])


@pytest.mark.parametrize("formats, rows", [
    (("Q4_K", "Q4_K", "Q4_K"), (24, 8, 13)),       # one format, whole tiles but the last: packed in place
    (("Q4_K", "Q4_K", "Q6_K"), (24, 16, 13)),      # Q4_K_M's q|k|v: a PackedStack, packed in place
    (("Q8_0", "Q8_0"), (13, 8)),                   # a part that ends mid-tile: the concatenating fallback
    (("Q4_0", "Q6_K"), (5, 8)),
])
def test_stacked_packing_into_one_buffer_has_the_bytes_of_packing_the_concatenation(library, formats, rows):
    """pack_stacked (each part packed straight into its slice of one buffer, as a load does) gives the same
    bytes and outputs as concatenating the blocks and packing that (one format) or stacking each part's
    packing (several)."""
    seed = case_seed("gguf-pack-stacked", *formats, *rows)
    k = 512
    parts = [random_weight(fmt, n, k, seed + i) for i, (fmt, n) in enumerate(zip(formats, rows, strict=True))]
    packed = pack_stacked(parts)
    if len(set(formats)) == 1:
        expected = pack(QuantizedWeight.cat(parts))
        assert packed.ggml_type == expected.ggml_type and packed.shape == expected.shape
    else:
        expected = stack([pack(p) for p in parts])
        assert packed.format == expected.format and [p.shape for p in packed.parts] == [p.shape for p in parts]
    assert torch.equal(packed.tiles, expected.tiles)
    x = random_x(3, k, seed + 9)
    assert torch.equal(gguf_linear(x, packed, out=poison(torch.empty(3, sum(rows)))), gguf_linear(x, expected))


def test_block_decoding_matches_the_gguf_package():
    """Our reading of the three block formats is the gguf package's (llama.cpp's Python reference)."""
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    for fmt in sorted(FORMATS):
        k = width(fmt, 512)
        weight = random_weight(fmt, 5, k, case_seed("gguf-decode", fmt))
        theirs = quants.dequantize(weight.data.numpy(), GGMLQuantizationType[fmt])
        assert torch.equal(weight.dequantize(), torch.from_numpy(theirs).float().reshape(5, k)), fmt


@pytest.mark.parametrize("fmt", ["Q8_0", "Q5_K"])
def test_without_the_kernel_the_reference_runs(monkeypatch, fmt):
    monkeypatch.setenv("KERNEL_LAB_CPU_KERNELS", "0")
    weight = random_weight(fmt, 9, width(fmt, 64), case_seed("gguf-off", fmt))
    x = random_x(3, weight.shape[1], case_seed("gguf-off", 1))
    assert torch.equal(gguf_linear(x, weight).double(), gguf_linear_reference(x, weight).float().double())
    ids = torch.tensor([8, 0])
    assert torch.equal(dequantize_rows(weight, ids), weight.dequantize()[ids])


# --------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_name_the_argument():
    weight = random_weight("Q4_1", 16, 64, case_seed("gguf-bad"))
    x = random_x(2, 64, case_seed("gguf-bad", 1))
    cases = [
        (lambda: gguf_linear(x.half(), weight), TypeError, "x must have dtype"),
        (lambda: gguf_linear(x[:, :32], weight), ValueError, "x must have 64 columns"),
        (lambda: gguf_linear(x[0], weight), ValueError, "x must be 2-D"),
        (lambda: gguf_linear(x.to("meta"), weight), ValueError, "x must be on the CPU"),
        (lambda: gguf_linear(x, weight.data), TypeError, "weight must be"),
        (lambda: gguf_linear(x, weight, bias=torch.ones(15)), ValueError, "bias must be"),
        (lambda: gguf_linear(x, weight, out=torch.empty(2, 15)), ValueError, "out must have shape"),
        (lambda: QuantizedWeight(7, weight.data, (16, 64)), ValueError, "ggml_type must be"),
        (lambda: QuantizedWeight(GGML_Q4_1, weight.data, (16, 80)), ValueError, "shape must be"),
        (lambda: QuantizedWeight(GGML_Q8_0, weight.data, (16, 64)), ValueError, "data must have shape"),
        (lambda: QuantizedWeight(GGML_Q4_1, weight.data.char(), (16, 64)), TypeError, "data must have dtype"),
        (lambda: QuantizedWeight(GGML_Q4_K, weight.data, (16, 64)), ValueError, "k a multiple of 256"),
        (lambda: dequantize_rows(weight, torch.tensor([3, 16])), ValueError, r"ids must lie in \[0, 16\)"),
        (lambda: dequantize_rows(weight, torch.tensor([0.0])), TypeError, "ids must have dtype"),
    ]
    for call, kind, message in cases:
        with pytest.raises(kind, match=message):
            call()


def test_kernel_threads_gives_the_cores_to_the_kernel_and_restores_torch(library):
    from kernel_lab.ops import gguf_linear as module

    before = torch.get_num_threads()
    weight = pack(random_weight("Q4_1", 24, 64, case_seed("threads-block")))
    x = random_x(3, 64, case_seed("threads-block-x"))
    expected = gguf_linear(x, weight, threads=1)
    with pytest.raises(RuntimeError, match="inside"):
        with module.kernel_threads(2):
            assert torch.get_num_threads() == 1 and module._step_threads == 2
            assert torch.equal(gguf_linear(x, weight), expected)
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before and module._step_threads is None


# ------------------------------------------------------------------------------- llama.cpp's own K-quants
def test_llama_cpp_quantized_k_blocks_through_the_kernel(library, make_gguf, tmp_path):
    """The K-quant blocks llama.cpp's quantizer writes (a tiny Q4_K_M of make_1b_gguf.py: Q4_K with Q6_K for
    some v, down and the lm_head) decode as the gguf package decodes them, and the kernel on them stays within
    the stated bound of float64 x @ W.T. Needs .venv-llamacpp (`make llama-cpp-env`), which CI does not build."""
    make = make_gguf
    if not make.llama_cpp_ready():
        pytest.skip("no .venv-llamacpp (make llama-cpp-env): llama.cpp's quantizer is not here")
    gguf = pytest.importorskip("gguf")
    path = make.build("tiny", ["Q4_K_M"], out=tmp_path, log=lambda *_: None)["Q4_K_M"]
    seen = set()
    for tensor in gguf.GGUFReader(path).tensors:
        fmt = tensor.tensor_type.name
        if fmt not in K_FORMATS or (fmt, tensor.name.split(".")[-2]) in seen:
            continue
        seen.add((fmt, tensor.name.split(".")[-2]))
        n, k = (int(d) for d in reversed(tensor.shape))
        weight = QuantizedWeight(FORMATS[fmt], torch.from_numpy(tensor.data.copy()).view(torch.uint8).view(n, -1),
                                 (n, k))
        theirs = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).float().reshape(n, k)
        assert torch.equal(weight.dequantize(), theirs), tensor.name
        x = random_x(3, k, case_seed("llama.cpp-k", tensor.name))
        error = (gguf_linear(x, pack(weight)).double() - x.double() @ theirs.double().T).abs()
        assert bool((error <= activation_rounding_bound(x, weight) + summation_tolerance(x, weight)).all())
    assert {f for f, _ in seen} == {"Q4_K", "Q6_K"}
