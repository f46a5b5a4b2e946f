"""Every C kernel's narrower builds (KERNEL_LAB_CPU_ISA=avx2 and scalar), on whatever x86-64 CPU runs the tests.

The machines that run this suite differ (AVX2 only, AVX-512, VNNI), and `-march=native` builds only the path
the machine's own CPU takes. KERNEL_LAB_CPU_ISA narrows every library below that, so an AVX-512 machine also
tests the AVX2 machine's code and the C fallback: each kernel, through the same entry points the engine calls,
against a reference on fresh random inputs; and the disassembly shows each build is the one asked for (no
512-bit registers in the AVX2 build, no 256-bit ones in the scalar build), so a variant that silently built
native would fail. gguf_linear's formats are compared per build in test_gguf_linear.py.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess

import pytest
import torch

from kernel_lab.harness.testing import assert_close, case_seed, generator, poison, randn
from kernel_lab.ops import allocate_kv_cache, cpu_kernels, gguf_linear
from kernel_lab.ops.kv_cache import dequantize_pages, element_scales, int8_rows, write_kv_reference
from kernel_lab.ops.paged_attention import paged_decode_attention_reference
from kernel_lab.ops.token_bitmask import apply_token_bitmask_reference

LIBRARIES = ("norm_activation", "paged_decode_attention", "token_bitmask", "gguf_linear")
NARROWER = ("avx2", "scalar")


@pytest.fixture(params=NARROWER)
def isa(request, monkeypatch):
    """KERNEL_LAB_CPU_ISA set to one narrower build for the test (skips where this CPU cannot run it)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the ISA variants are x86-64 builds")
    if cpu_kernels.compiler() is None:
        pytest.skip("no C compiler ($CC or cc on PATH) to build kernel_lab/csrc/cpu")
    flags = set(cpu_kernels._cpu_flags().split())
    if request.param == "avx2" and not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("this CPU does not run AVX2 code")
    monkeypatch.delenv("KERNEL_LAB_CPU_KERNELS", raising=False)
    monkeypatch.setenv("KERNEL_LAB_CPU_ISA", request.param)
    assert cpu_kernels.isa() == request.param
    return request.param


def test_bad_isa_values_are_refused_by_name(monkeypatch):
    monkeypatch.setenv("KERNEL_LAB_CPU_ISA", "avx1024")
    with pytest.raises(ValueError, match=r"KERNEL_LAB_CPU_ISA must be one of native, avx2, scalar; got 'avx1024'"):
        cpu_kernels.load_library("norm_activation")
    monkeypatch.setenv("KERNEL_LAB_CPU_ISA", "")
    assert cpu_kernels.isa() == "native"


@pytest.mark.parametrize("name", LIBRARIES)
def test_each_library_is_the_build_asked_for(isa, name):
    """The loaded library is the cached build with the ISA's flags, and its code says so."""
    lib = cpu_kernels.load_library(name)
    assert lib is not None, f"the {isa} build of {name} failed"
    expected = cpu_kernels.library_path(cpu_kernels.compiler(), cpu_kernels._source(name), cpu_kernels.ISA_FLAGS[isa])
    assert lib._name == str(expected)
    if shutil.which("objdump") is None:
        pytest.skip("no objdump to read the build's instructions")
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", lib._name], capture_output=True, text=True,
                             check=True).stdout
    assert not re.search(r"%zmm", listing), f"the {isa} build of {name} uses 512-bit registers"
    if isa == "scalar":
        assert not re.search(r"%ymm", listing), f"the scalar build of {name} uses 256-bit registers"
    else:
        assert re.search(r"%ymm", listing), f"the avx2 build of {name} has no 256-bit code"


def _norm64(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("rows, h", [(3, 576), (5, 77), (1, 2048)])
def test_add_rms_norm(isa, rows, h):
    seed = case_seed("isa-norm", isa, rows, h)
    x, residual = randn((rows, h), torch.float32, "cpu", seed), randn((rows, h), torch.float32, "cpu", seed + 1)
    weight = randn((h,), torch.float32, "cpu", seed + 2)
    out, residual_out = poison(torch.empty(rows, h)), poison(torch.empty(rows, h))
    assert cpu_kernels.add_rms_norm_cpu(x, residual, weight, 1e-5, out, residual_out)
    assert_close(residual_out, x.double() + residual.double(), torch.float32)
    assert_close(out, _norm64(x.double() + residual.double(), weight, 1e-5), torch.float32)
    alone = poison(torch.empty(rows, h))
    assert cpu_kernels.add_rms_norm_cpu(x, None, weight, 1e-6, alone, None)
    assert_close(alone, _norm64(x, weight, 1e-6), torch.float32)


def _gelu64(g, tanh_approximation):
    if tanh_approximation:
        return 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3)))
    return 0.5 * g * (1 + torch.erf(g / 2 ** 0.5))


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("rows, d", [(4, 1536), (3, 37)])
def test_gated_activation(isa, activation, rows, d):
    x = randn((rows, 2 * d), torch.float32, "cpu", case_seed("isa-act", isa, activation, rows, d)) * 3
    out = poison(torch.empty(rows, d))
    assert cpu_kernels.gated_activation_cpu(x, out, activation)
    g, up = x[:, :d].double(), x[:, d:].double()
    gate = g * torch.sigmoid(g) if activation == "silu" else _gelu64(g, activation == "gelu_tanh")
    assert_close(out, gate * up, torch.float32)


def _paged_case(seed, lengths, hq, hkv, d, block_size):
    """Random caches and tables: sequence i's blocks are a random distinct set of the pool."""
    g = generator(seed)
    max_blocks = max(-(-n // block_size) for n in lengths)
    num_blocks = len(lengths) * max_blocks + 3
    order = torch.randperm(num_blocks, generator=g)
    tables = order[:len(lengths) * max_blocks].view(len(lengths), max_blocks).to(torch.int32)
    kc = randn((num_blocks, block_size, hkv, d), torch.float32, "cpu", seed + 1)
    vc = randn((num_blocks, block_size, hkv, d), torch.float32, "cpu", seed + 2)
    return kc, vc, tables, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("hq, hkv, d, block_size", [(9, 3, 64, 16), (4, 2, 128, 8), (6, 3, 96, 16)])
@pytest.mark.parametrize("window", [0, 5])
def test_paged_decode_attention(isa, hq, hkv, d, block_size, window):
    seed = case_seed("isa-attn", isa, hq, hkv, d, block_size, window)
    kc, vc, tables, lens = _paged_case(seed, [1, 2 * block_size + 3, 70], hq, hkv, d, block_size)
    q = randn((3, hq, d), torch.float32, "cpu", seed + 3) * 2
    out = poison(torch.empty_like(q))
    assert cpu_kernels.paged_decode_attention_cpu(q, kc, vc, tables, lens, 0.6 * d ** -0.5, out, window)
    expected = paged_decode_attention_reference(q.double(), kc.double(), vc.double(), tables, lens, 0.6 * d ** -0.5,
                                                sliding_window=window or None)
    assert_close(out, expected, torch.float32)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    x = x.double()
    return x * cos.double()[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin.double()[:, None]


@pytest.mark.parametrize("hq, hkv, d, block_size", [(9, 3, 64, 16), (4, 4, 128, 8)])
def test_fused_rope_write_attention(isa, hq, hkv, d, block_size):
    """The engine's one-call layer attention for decode rows: RoPE, the KV write and attention, against the
    same three steps done in float64 (the write at each row's slot, then the reference attention)."""
    seed = case_seed("isa-fused", isa, hq, hkv, d, block_size)
    lengths = [block_size + 4, 3, 2 * block_size]  # each row decodes its last position
    kc, vc, tables, lens = _paged_case(seed, lengths, hq, hkv, d, block_size)
    positions = [n - 1 for n in lengths]
    slots = torch.tensor([int(tables[r, p // block_size]) * block_size + p % block_size
                          for r, p in enumerate(positions)])
    qkv = randn((3, (hq + 2 * hkv) * d), torch.float32, "cpu", seed + 3)
    angles = torch.tensor(positions, dtype=torch.float32)[:, None] * (
        10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d))[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q, k, v = qkv.view(3, -1, d).split([hq, hkv, hkv], dim=1)
    expected_k, expected_v = kc.double().clone(), vc.double().clone()
    expected_k.view(-1, hkv, d)[slots], expected_v.view(-1, hkv, d)[slots] = _rope(k, cos, sin), v.double()
    expected = paged_decode_attention_reference(_rope(q, cos, sin), expected_k, expected_v, tables, lens, 0.3)
    out = poison(torch.empty(3, hq * d))
    cpu_kernels.rope_write_paged_attention_cpu(qkv, cos, sin, slots, kc, vc, tables, lens, hq, 0.3, out)
    assert_close(kc, expected_k, torch.float32)
    assert torch.equal(vc.double(), expected_v)
    assert_close(out.view(3, hq, d), expected, torch.float32)


def _scaled_pages(kc, vc, lengths, tables, block_size, dtype=torch.int8):
    """The float32 pool's rows of each sequence written into int8 (or fp8) pages in position order by the
    reference (kv_cache.write_kv_reference, once per token, as decode appends)."""
    _, _, hkv, d = kc.shape
    k8, v8, ks, vs = allocate_kv_cache(kc.shape[0], block_size, hkv, d, dtype)
    for b, n in enumerate(lengths):
        for t in range(n):
            slot = torch.tensor([int(tables[b, t // block_size]) * block_size + t % block_size])
            write_kv_reference(kc.view(-1, hkv, d)[slot], vc.view(-1, hkv, d)[slot], k8, v8, slot, ks, vs)
    return k8, v8, ks, vs


def _dequantized_pages(k8, v8, ks, vs, page_dtype):
    """Float64 K and V from scaled pages, int8 rows rotated back (they hold H k, H v: kv_cache's docstring)."""
    kd, vd = (dequantize_pages(c, element_scales(s, page_dtype, c.shape[-1])).double() for c, s in ((k8, ks), (v8, vs)))
    if page_dtype == torch.int8:
        kd, vd = int8_rows(kd).double(), int8_rows(vd).double()
    return kd, vd


@pytest.mark.parametrize("hq, hkv, d, block_size", [(9, 3, 64, 16), (6, 3, 96, 16), (5, 5, 36, 8)])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("page_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_paged_decode_attention_scaled_pages(isa, page_dtype, hq, hkv, d, block_size, window):
    """int8 and fp8 pages: against float64 attention over their dequantised values (the read is exact, so
    float32's tolerance applies)."""
    seed = case_seed("isa-attn-int8", isa, hq, hkv, d, block_size, window)
    lengths = [1, 2 * block_size + 3, 70]
    kc, vc, tables, lens = _paged_case(seed, lengths, hq, hkv, d, block_size)
    kc[::3] *= 5.0  # rows of different ranges (fp8: pages that grow after their first tokens)
    k8, v8, ks, vs = _scaled_pages(kc, vc, lengths, tables, block_size, page_dtype)
    q = randn((3, hq, d), torch.float32, "cpu", seed + 3) * 2
    out = poison(torch.empty_like(q))
    assert cpu_kernels.paged_decode_attention_cpu(q, k8, v8, tables, lens, 0.6 * d ** -0.5, out, window,
                                                  k_scale=ks, v_scale=vs)
    kd, vd = _dequantized_pages(k8, v8, ks, vs, page_dtype)
    expected = paged_decode_attention_reference(q.double(), kd, vd, tables, lens, 0.6 * d ** -0.5,
                                                sliding_window=window or None)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("hq, hkv, d, block_size", [(9, 3, 64, 16), (4, 4, 36, 8)])
@pytest.mark.parametrize("page_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_fused_rope_write_attention_scaled_pages(isa, page_dtype, hq, hkv, d, block_size):
    """The fused call on int8 (fp8) pages: V written as the reference writes it (per token, byte for byte,
    scales too), K within one code (one E4M3 step) of the reference's write of the float64 rotation (the
    rotation is float32; int8's per-token K scales within float32's rounding of it, fp8's power-of-two page
    scales equal), and each row's attention over the pages it left, against float64."""
    seed = case_seed("isa-fused-int8", isa, hq, hkv, d, block_size)
    lengths = [block_size + 4, 3, 2 * block_size]
    kc, vc, tables, lens = _paged_case(seed, lengths, hq, hkv, d, block_size)
    k8, v8, ks, vs = _scaled_pages(kc, vc, [n - 1 for n in lengths], tables, block_size, page_dtype)
    positions = [n - 1 for n in lengths]
    slots = torch.tensor([int(tables[r, p // block_size]) * block_size + p % block_size
                          for r, p in enumerate(positions)])
    qkv = randn((3, (hq + 2 * hkv) * d), torch.float32, "cpu", seed + 3) * 4  # grows its pages
    angles = torch.tensor(positions, dtype=torch.float32)[:, None] * (
        10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d))[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q, k, v = qkv.view(3, -1, d).split([hq, hkv, hkv], dim=1)
    rk, rv, rks, rvs = k8.clone(), v8.clone(), ks.clone(), vs.clone()
    write_kv_reference(_rope(k, cos, sin).float(), v, rk, rv, slots, rks, rvs)  # distinct pages: one call is per token
    out = poison(torch.empty(3, hq * d))
    cpu_kernels.rope_write_paged_attention_cpu(qkv, cos, sin, slots, k8, v8, tables, lens, hq, 0.3, out,
                                               k_scale=ks, v_scale=vs)
    assert torch.equal(v8.view(torch.uint8), rv.view(torch.uint8)) and torch.equal(vs, rvs)
    if page_dtype == torch.int8:
        assert torch.allclose(ks, rks, rtol=1e-6, atol=0)
        assert int((k8.int() - rk.int()).abs().max()) <= 1
    else:  # one E4M3 step: at most 2^-3 of the value, or 2^-9 of the scale among subnormal codes
        assert torch.equal(ks, rks)
        ours, theirs = (dequantize_pages(c, ks[:, None, :, None]) for c in (k8, rk))
        assert bool(((ours - theirs).abs() <= 2 ** -3 * theirs.abs() + 2 ** -9 * ks[:, None, :, None]).all())
    kd, vd = _dequantized_pages(k8, v8, ks, vs, page_dtype)
    expected = paged_decode_attention_reference(_rope(q, cos, sin), kd, vd, tables, lens, 0.3)
    assert_close(out.view(3, hq, d), expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_token_bitmask(isa, dtype):
    g = generator(case_seed("isa-bitmask", isa, str(dtype)))
    vocab = 1000
    logits = torch.randn(6, vocab, generator=g).to(dtype)
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (3, -(-vocab // 32)), dtype=torch.int64, generator=g).to(torch.int32)
    rows = torch.tensor([4, 0, 2])
    expected = apply_token_bitmask_reference(logits.clone(), bitmask, rows)
    assert cpu_kernels.apply_token_bitmask_cpu(logits, bitmask, rows)
    assert torch.equal(logits, expected)


def test_gguf_linear_takes_the_isa(isa):
    """The engine's gguf_linear library follows KERNEL_LAB_CPU_ISA (its products per build: test_gguf_linear)."""
    assert gguf_linear.kernel_isa() == isa
