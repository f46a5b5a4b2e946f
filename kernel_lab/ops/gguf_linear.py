"""Linear layers on a GGUF's quantized weights, on the CPU: y = x @ W.T with W kept in its Q4_0, Q4_1, Q8_0,
Q4_K, Q5_K or Q6_K blocks (kernel: `kernel_lab/csrc/cpu/gguf_linear.c` and `gguf_kquant_tiles.h`; design and
measurements: projects/09_engine/README.md).

    w = QuantizedWeight(GGML_Q4_1, data, (n, k))   # data: uint8 [n, k / 32 * block bytes], the file's rows
    p = pack(w)                                    # the same bytes regrouped in tiles of 8 rows (at load)
    y = gguf_linear(x, p)                          # x: float32 [m, k] on CPU -> y: float32 [m, n]

Block formats (32 weights each, fp16 scales): Q4_0 w = d (q - 8), q in 0..15; Q4_1 w = d q + m; Q8_0 w = d q,
q in -128..127. K-quants are super-blocks of 256 (layouts: gguf_kquant_tiles.h): Q4_K and Q5_K
w = d sc q - dmin m per sub-block of 32 (6-bit sc, m; q in 0..15 or 0..31), Q6_K w = d sc (q - 32) per 16
(int8 sc, q in 0..63). Each row of x is quantized to int8 per block of 32 (d = amax / 127, q = round(x / d)) and
the block dot products are integer; `gguf_linear_reference` computes exactly that in float64, and
`quantize_activations` is the torch form of the activation rounding, so both paths can be checked.
"""

from __future__ import annotations

import functools
import mmap
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import cpu_kernels
from .common import check_out, check_tensor

GGML_Q4_0, GGML_Q4_1, GGML_Q8_0 = 2, 3, 8
GGML_Q4_K, GGML_Q5_K, GGML_Q6_K = 12, 13, 14
K_QUANTS = (GGML_Q4_K, GGML_Q5_K, GGML_Q6_K)
BLOCK = 32     # weights per block of Q4_0/Q4_1/Q8_0, per sub-block of Q4_K/Q5_K, per activation block
SUPER_BLOCK = 256
BLOCK_BYTES = {GGML_Q4_0: 18, GGML_Q4_1: 20, GGML_Q8_0: 34, GGML_Q4_K: 144, GGML_Q5_K: 176, GGML_Q6_K: 210}
BLOCK_WEIGHTS = {t: SUPER_BLOCK if t in K_QUANTS else BLOCK for t in BLOCK_BYTES}
FORMAT_NAMES = {GGML_Q4_0: "Q4_0", GGML_Q4_1: "Q4_1", GGML_Q8_0: "Q8_0", GGML_Q4_K: "Q4_K", GGML_Q5_K: "Q5_K",
                GGML_Q6_K: "Q6_K"}
FORMATS = {name: t for t, name in FORMAT_NAMES.items()}


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [n, k] as rows of GGUF blocks: `data` is uint8 [n, k / block weights * block bytes], on CPU."""

    ggml_type: int
    data: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self):
        if self.ggml_type not in BLOCK_BYTES:
            raise ValueError(f"ggml_type must be one of {FORMATS}, got {self.ggml_type!r}")
        n, k = self.shape
        block = BLOCK_WEIGHTS[self.ggml_type]
        if n < 1 or k < block or k % block:
            raise ValueError(f"shape must be (n >= 1, k a multiple of {block}) for {self.format}, got {self.shape}")
        check_tensor("data", self.data, dtypes=(torch.uint8,), ndim=2)
        expected = (n, k // block * BLOCK_BYTES[self.ggml_type])
        if tuple(self.data.shape) != expected:
            raise ValueError(f"data must have shape {expected} for a {self.format} weight of shape {self.shape}, "
                             f"got {tuple(self.data.shape)}")
        if self.data.device.type != "cpu" or not self.data.is_contiguous():
            raise ValueError("data must be a contiguous CPU tensor")

    @property
    def format(self) -> str:
        return FORMAT_NAMES[self.ggml_type]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several weights of one format and width, stacked (q|k|v, gate|up)."""
        if len({(p.ggml_type, p.shape[1]) for p in parts}) != 1:
            raise ValueError("only weights of one format and one width can be stacked")
        return QuantizedWeight(parts[0].ggml_type, torch.cat([p.data for p in parts]),
                               (sum(p.shape[0] for p in parts), parts[0].shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [n, k] the blocks encode (computed in torch; the reference's weights)."""
        n, k = self.shape
        if self.ggml_type in K_QUANTS:
            scaled, mins = _kquant_parts(self)
            return (scaled - mins.repeat_interleave(BLOCK, dim=1)).float()
        blocks = self.data.view(n, k // BLOCK, BLOCK_BYTES[self.ggml_type])
        d = blocks[..., 0:2].contiguous().view(torch.float16).float()          # [n, nb, 1]
        if self.ggml_type == GGML_Q8_0:
            q = blocks[..., 2:].contiguous().view(torch.int8).float()
            return (d * q).view(n, k)
        packed = blocks[..., 4:] if self.ggml_type == GGML_Q4_1 else blocks[..., 2:]
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()            # weights j and j + 16
        if self.ggml_type == GGML_Q4_1:
            m = blocks[..., 2:4].contiguous().view(torch.float16).float()
            return (d * q + m).view(n, k)
        return (d * (q - 8)).view(n, k)


TILE_ROWS = 8


@dataclass(frozen=True)
class PackedWeight:
    """A QuantizedWeight regrouped for the kernel: tiles of 8 rows, each block's scales then its quants
    interleaved 4 bytes per row (layout: the comment at the top of gguf_linear.c). Same bytes as the file's
    blocks, plus zero rows padding the last tile. `tiles` is uint8 [ceil(n / 8), k / 32 * 8 * block bytes]."""

    ggml_type: int
    tiles: torch.Tensor
    shape: tuple[int, int]

    @property
    def format(self) -> str:
        return FORMAT_NAMES[self.ggml_type]

    @property
    def nbytes(self) -> int:
        return self.tiles.numel()

    def unpack(self) -> QuantizedWeight:
        n, k = self.shape
        if self.ggml_type in K_QUANTS:
            return _kquant_unpack(self)
        nb, bb = k // BLOCK, BLOCK_BYTES[self.ggml_type]
        t = self.tiles.view(-1, nb, TILE_ROWS * bb)
        scales = 32 if self.ggml_type == GGML_Q4_1 else 16
        parts = [t[..., 0:16].reshape(-1, nb, TILE_ROWS, 2)]
        if self.ggml_type == GGML_Q4_1:
            parts.append(t[..., 16:32].reshape(-1, nb, TILE_ROWS, 2))
        groups = (bb - scales // TILE_ROWS) // 4            # dwords of quants per row and block: 4 or 8
        quants = t[..., scales:].reshape(-1, nb, groups, TILE_ROWS, 4).permute(0, 1, 3, 2, 4)
        parts.append(quants.reshape(-1, nb, TILE_ROWS, groups * 4))
        rows = torch.cat(parts, dim=-1).permute(0, 2, 1, 3).reshape(-1, nb * bb)
        return QuantizedWeight(self.ggml_type, rows[:n].contiguous(), self.shape)


@dataclass(frozen=True)
class PackedStack:
    """Row-stacked weights of different formats, one output: a Q4_K_M file's q|k|v or gate|up where v or
    one of the pair is Q6_K. Each part is computed into its columns of y. The parts' tiles are views of
    one buffer, `tiles`, so the stack is one allocation like a PackedWeight."""

    parts: tuple[PackedWeight, ...]
    tiles: torch.Tensor
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.tiles.numel()

    @property
    def format(self) -> str:
        return "+".join(p.format for p in self.parts)


def stack(parts: list[PackedWeight]) -> PackedStack:
    """The rows of `parts` (one width, any formats) as one layer's weight."""
    if len({p.shape[1] for p in parts}) != 1:
        raise ValueError("only weights of one width can be stacked")
    tiles = torch.cat([p.tiles.reshape(-1) for p in parts])
    views, start = [], 0
    for p in parts:
        views.append(PackedWeight(p.ggml_type, tiles[start:start + p.tiles.numel()].view(p.tiles.shape), p.shape))
        start += p.tiles.numel()
    return PackedStack(tuple(views), tiles, (sum(p.shape[0] for p in parts), parts[0].shape[1]))


_HUGE_PAGE = 2 << 20


def _tile_buffer(nbytes: int) -> torch.Tensor:
    """Uninitialised bytes for packed tiles. A buffer of a few huge pages or more is its own anonymous
    mapping, advised for transparent huge pages before the packer first writes it: a decode step streams
    every weight once, and with 4 KiB pages each page costs a TLB walk and ends a hardware prefetch stream
    (on a 2-core Zen 4, a one-row Q4_K GEMV over weights far larger than L3 ran 18 against 21 GB/s, C
    harness, ad hoc). Where the kernel has no THP, or only `never`, the advice is a no-op."""
    if nbytes < 2 * _HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # shared anonymous memory is shmem, not THP
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass
    return torch.frombuffer(region, dtype=torch.uint8)


def _tiles_shape(weight: QuantizedWeight) -> tuple[int, int]:
    n, k = weight.shape
    widened = BLOCK_BYTES[weight.ggml_type] + _WIDE_EXTRA.get(weight.ggml_type, 0)
    return -(-n // TILE_ROWS), k // BLOCK_WEIGHTS[weight.ggml_type] * TILE_ROWS * widened


def _pack_into(lib, weight: QuantizedWeight, tiles: torch.Tensor) -> PackedWeight:
    if lib.kl_gguf_pack(weight.ggml_type, weight.data.data_ptr(), *weight.shape, tiles.data_ptr()) != 0:
        raise RuntimeError("kl_gguf_pack failed")
    return PackedWeight(weight.ggml_type, tiles, weight.shape)


def pack(weight: QuantizedWeight, use_kernel: bool = True) -> PackedWeight:
    """Regroup a weight's blocks into the kernel's 8-row tiles (done once, at load): by the C packer where
    the library loads (a 1B model in about a second), else by these torch gathers (tens of seconds at
    that size); the tests hold the two to the same bytes."""
    _check_weight(weight)
    lib = _library() if use_kernel else None
    if lib is not None:
        rows, cols = _tiles_shape(weight)
        return _pack_into(lib, weight, _tile_buffer(rows * cols).view(rows, cols))
    if weight.ggml_type in K_QUANTS:
        return _kquant_pack(weight)
    n, k = weight.shape
    nb, bb = k // BLOCK, BLOCK_BYTES[weight.ggml_type]
    padded = -(-n // TILE_ROWS) * TILE_ROWS
    blocks = torch.zeros(padded, nb, bb, dtype=torch.uint8)
    blocks[:n] = weight.data.view(n, nb, bb)
    blocks = blocks.view(-1, TILE_ROWS, nb, bb).permute(0, 2, 1, 3)     # [tiles, nb, 8 rows, bb]
    scales = 4 if weight.ggml_type == GGML_Q4_1 else 2
    parts = [blocks[..., 0:2].reshape(-1, nb, 16)]
    if weight.ggml_type == GGML_Q4_1:
        parts.append(blocks[..., 2:4].reshape(-1, nb, 16))
    groups = (bb - scales) // 4
    quants = blocks[..., scales:].reshape(-1, nb, TILE_ROWS, groups, 4).permute(0, 1, 3, 2, 4)
    parts.append(quants.reshape(-1, nb, groups * TILE_ROWS * 4))
    tiles = torch.cat(parts, dim=-1).reshape(padded // TILE_ROWS, nb * TILE_ROWS * bb).contiguous()
    return PackedWeight(weight.ggml_type, tiles, weight.shape)


def pack_stacked(parts: list[QuantizedWeight]) -> PackedWeight | PackedStack:
    """Row-stacked weights (q|k|v, gate|up) packed straight into one buffer, each part into its slice, so a
    load copies each block once (not a concatenation of the blocks first and then a packing of that). One
    format: a PackedWeight, whose tiles are the parts' tiles in order (every part but the last fills whole
    tiles); several formats: a PackedStack. Same bytes as pack(QuantizedWeight.cat(parts)) / stack(...)."""
    for part in parts:
        _check_weight(part)
    if len({p.shape[1] for p in parts}) != 1:
        raise ValueError("only weights of one width can be stacked")
    one_format = len({p.ggml_type for p in parts}) == 1
    lib = _library()
    if lib is None or any(p.shape[0] % TILE_ROWS for p in parts[:-1]):
        return pack(QuantizedWeight.cat(parts)) if one_format else stack([pack(p) for p in parts])
    shapes = [_tiles_shape(p) for p in parts]
    buffer = _tile_buffer(sum(r * c for r, c in shapes))
    views, start = [], 0
    for part, (r, c) in zip(parts, shapes, strict=True):
        views.append(_pack_into(lib, part, buffer[start:start + r * c].view(r, c)))
        start += r * c
    shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
    if one_format:
        return PackedWeight(parts[0].ggml_type, buffer.view(-1, shapes[0][1]), shape)
    return PackedStack(tuple(views), buffer, shape)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block of 32 along the last dim: (q int8 [m, k], d float32 [m, k/32], s = d * sum(q) [m, k/32]),
    rounded as the C kernel rounds (float32, ties to even)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).to(torch.int8)
    s = d * q.sum(dim=-1, dtype=torch.int32).float()
    return q.reshape(m, k), d, s


def gguf_linear_reference(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """What the kernel computes, in float64: the same int8 activations, exact integer block dots, then the
    block scales. It differs from the kernel only by float32 rounding of the per-block sums."""
    n, k = weight.shape
    nb = k // BLOCK
    q, d, s = quantize_activations(x)
    if weight.ggml_type in K_QUANTS:
        # w = scaled - min per 32 (Q6_K: min 0), so sum_j w_j x_j d_x = d_x (scaled . q) - min s_x, as the kernel
        # splits it; every product below is exact in float64 but for the last bits of d_x * scaled.
        scaled, mins = _kquant_parts(weight)
        dequantized_x = (q.double().view(-1, nb, BLOCK) * d.double()[..., None]).view(-1, k)
        return dequantized_x @ scaled.T - s.double() @ mins.T
    blocks = weight.data.view(n, nb, BLOCK_BYTES[weight.ggml_type])
    wd = blocks[..., 0:2].contiguous().view(torch.float16).double()[..., 0]   # [n, nb]
    if weight.ggml_type == GGML_Q8_0:
        wq = blocks[..., 2:].contiguous().view(torch.int8).double()
        corr = torch.zeros_like(wd)
    else:
        packed = blocks[..., 4:] if weight.ggml_type == GGML_Q4_1 else blocks[..., 2:]
        wq = torch.cat([packed & 0x0F, packed >> 4], dim=-1).double()
        corr = (blocks[..., 2:4].contiguous().view(torch.float16).double()[..., 0]
                if weight.ggml_type == GGML_Q4_1 else -8.0 * wd)
    idot = torch.einsum("mbj,nbj->mnb", q.double().view(-1, nb, BLOCK), wq)  # exact: integers below 2^53
    y = (idot * wd[None] * d.double()[:, None, :]).sum(-1) + (corr[None] * s.double()[:, None, :]).sum(-1)
    return y


_step_threads: int | None = None


@contextmanager
def kernel_threads(threads: int):
    """Within the block `gguf_linear` runs on `threads` threads and torch's own ops on one.

    torch's OpenMP workers spin for a while after each op, and so do this kernel's workers after each call:
    on the same cores the two fight. Measured on a 2-core machine, a batch-1 decode step with both at 2
    threads ran at 18 tok/s, with torch at 1 and the kernel at 2 at 31 (and 28 with both at 1). An engine
    step on quantized weights spends its time in this kernel, so the step gives it the cores."""
    global _step_threads
    previous, previous_torch = _step_threads, torch.get_num_threads()
    _step_threads = max(1, int(threads))
    torch.set_num_threads(1)
    try:
        yield
    finally:
        _step_threads = previous
        torch.set_num_threads(previous_torch)


def _library():
    return cpu_kernels.load_library("gguf_linear")


def kernel_available() -> bool:
    """True when the C kernel builds and loads here (a C compiler, and KERNEL_LAB_CPU_KERNELS is not 0)."""
    return _library() is not None


def kernel_isa() -> str | None:
    lib = _library()
    return None if lib is None else lib.kl_gguf_isa().decode()


def _check_weight(weight, packed_ok: bool = False) -> None:
    kinds = (QuantizedWeight, PackedWeight) if packed_ok else (QuantizedWeight,)
    if not isinstance(weight, kinds):
        raise TypeError(f"weight must be a {' or '.join(k.__name__ for k in kinds)}, got {type(weight).__name__}")


def _check_arguments(x, weight, bias, out) -> None:
    if not isinstance(weight, PackedStack):
        _check_weight(weight, packed_ok=True)
    check_tensor("x", x, dtypes=(torch.float32,), ndim=2)
    n, k = weight.shape
    m = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"x must have {k} columns (the weight's in-features), got shape {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"x must be on the CPU (quantized GGUF weights run on the CPU), got {x.device}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=(torch.float32,), ndim=1)
        if bias.shape[0] != n or bias.device.type != "cpu":
            raise ValueError(f"bias must be a CPU tensor of shape ({n},), got {tuple(bias.shape)} on {bias.device}")
    check_out("out", out, (m, n), torch.float32, x.device)
    if out is not None and out.stride(-1) != 1:
        raise ValueError(f"out must be contiguous in its last dimension, got strides {out.stride()}")


def gguf_linear(x: torch.Tensor, weight: PackedWeight | QuantizedWeight | PackedStack, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None, threads: int | None = None, validate: bool = True) -> torch.Tensor:
    """y [m, n] = x [m, k] @ W.T (+ bias), W in GGUF blocks. x: float32 on CPU, stride 1 in its last dim.
    `threads` defaults to the count of an enclosing `kernel_threads` block, else torch's intra-op thread
    count. A QuantizedWeight is packed on every call (layers pack once, at load). Without the C kernel (no
    compiler, or KERNEL_LAB_CPU_KERNELS=0) it computes the float64 reference, slowly. `validate=False`
    skips the argument checks, for a layer whose shapes and dtypes were fixed at load (QuantizedLinear):
    for a decode step's few rows they cost a sizeable part of the kernel's time."""
    if validate:
        _check_arguments(x, weight, bias, out)
    n, k = weight.shape
    m = x.shape[0]
    if x.stride(-1) != 1 and k > 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32) if out is None else out
    if isinstance(weight, PackedStack):
        start = 0
        for part in weight.parts:
            gguf_linear(x, part, out=y[:, start:start + part.shape[0]], threads=threads, validate=False)
            start += part.shape[0]
        return y if bias is None else y.add_(bias)
    lib = _library()
    if lib is None:
        y.copy_(gguf_linear_reference(x, weight.unpack() if isinstance(weight, PackedWeight) else weight))
    else:
        weight = pack(weight) if isinstance(weight, QuantizedWeight) else weight
        threads = cpu_kernels.step_threads(threads)
        status = lib.kl_gguf_linear(weight.ggml_type, weight.tiles.data_ptr(), n, k, x.data_ptr(), m,
                                    x.stride(0), y.data_ptr(), y.stride(0), threads)
        if status != 0:
            raise RuntimeError(f"kl_gguf_linear failed with status {status}")
    if bias is not None:
        y += bias
    return y


def dequantize_rows(weight: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """float32 [len(ids), k]: the listed rows of W (an embedding lookup on a quantized table)."""
    _check_weight(weight, packed_ok=True)
    weight = pack(weight) if isinstance(weight, QuantizedWeight) else weight
    check_tensor("ids", ids, dtypes=(torch.int32, torch.int64), ndim=1)
    n, k = weight.shape
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise ValueError(f"ids must lie in [0, {n}), got values in [{int(ids.min())}, {int(ids.max())}]")
    ids = ids.to(device="cpu", dtype=torch.int64).contiguous()
    lib = _library()
    if lib is None:
        return weight.unpack().dequantize()[ids]
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    if lib.kl_gguf_dequantize_rows(weight.ggml_type, weight.tiles.data_ptr(), k, ids.data_ptr(), ids.numel(),
                                   out.data_ptr()) != 0:
        raise RuntimeError("kl_gguf_dequantize_rows failed")
    return out


# ------------------------------------------------------------------------------------------------ K-quants
def _kquant_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes [..., 12] -> the 8 sub-blocks' 6-bit scales and mins, uint8 [..., 8] each."""
    low, high, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([low & 0x3F, (rest & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    mins = torch.cat([high & 0x3F, (rest >> 4) | ((high >> 2) & 0x30)], dim=-1)
    return scales, mins


def _kquant_pack_scales_mins(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The inverse of _kquant_scales_mins (a bijection: each of the 96 bits is used once)."""
    return torch.cat([(scales[..., :4] & 0x3F) | ((scales[..., 4:] >> 4) << 6),
                      (mins[..., :4] & 0x3F) | ((mins[..., 4:] >> 4) << 6),
                      (scales[..., 4:] & 0x0F) | ((mins[..., 4:] & 0x0F) << 4)], dim=-1)


def _kquant_parts(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(scaled float64 [n, k], mins float64 [n, k / 32]) with w = scaled - min of the weight's 32-block:
    Q4_K/Q5_K scaled = d sc q and min = dmin m; Q6_K scaled = d sc (q - 32) and min = 0. Exact in float64."""
    n, k = weight.shape
    sbs = k // SUPER_BLOCK
    blocks = weight.data.view(n, sbs, BLOCK_BYTES[weight.ggml_type])

    def half(lo):
        return blocks[..., lo:lo + 2].contiguous().view(torch.float16).double()    # [n, sbs, 1]

    if weight.ggml_type == GGML_Q6_K:
        ql, qh = blocks[..., 0:128].reshape(n, sbs, 2, 64), blocks[..., 128:192].reshape(n, sbs, 2, 1, 32)
        low = torch.stack([ql & 0x0F, ql >> 4], dim=-2).reshape(n, sbs, 2, 4, 32)
        high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 0x03
        codes = (low | (high << 4)).reshape(n, sbs, 16, 16).double() - 32.0
        scales = blocks[..., 192:208].contiguous().view(torch.int8).double()       # [n, sbs, 16]
        scaled = half(208)[..., None] * scales[..., None] * codes
        return scaled.reshape(n, k), torch.zeros(n, k // BLOCK, dtype=torch.float64)
    scales, mins = _kquant_scales_mins(blocks[..., 4:16])
    qs = blocks[..., -128:].reshape(n, sbs, 4, 1, 32)
    codes = ((qs >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]) & 0x0F).reshape(n, sbs, 8, 32)
    if weight.ggml_type == GGML_Q5_K:
        qh = blocks[..., 16:48].reshape(n, sbs, 1, 32)
        codes = codes | (((qh >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1) << 4)
    scaled = (half(0) * scales.double())[..., None] * codes.double()
    return scaled.reshape(n, k), (half(2) * mins.double()).reshape(n, k // BLOCK)


# A K-quant block with its 6-bit scales and mins widened to a byte each (Q4_K, Q5_K): d, dmin, sc[8], m[8], rest.
_WIDE_EXTRA = {GGML_Q4_K: 4, GGML_Q5_K: 4, GGML_Q6_K: 0}


def _widen(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    if not _WIDE_EXTRA[ggml_type]:
        return blocks
    return torch.cat([blocks[..., 0:4], *_kquant_scales_mins(blocks[..., 4:16]), blocks[..., 16:]], dim=-1)


def _narrow(wide: torch.Tensor, ggml_type: int) -> torch.Tensor:
    if not _WIDE_EXTRA[ggml_type]:
        return wide
    return torch.cat([wide[..., 0:4], _kquant_pack_scales_mins(wide[..., 4:12], wide[..., 12:20]), wide[..., 20:]],
                     dim=-1)


@functools.lru_cache(maxsize=None)
def _kquant_tile_order(ggml_type: int) -> torch.Tensor:
    """For each byte of a tile super-block (gguf_kquant_tiles.h's layout), its index in the 8 rows' widened
    blocks [8, wide bytes] flattened: the tile is that gather, and unpacking its inverse."""
    wide = BLOCK_BYTES[ggml_type] + _WIDE_EXTRA[ggml_type]
    rows = range(TILE_ROWS)

    def vectors(start):  # 8 vectors of 32 B: vector v, lane i = bytes start + 4v .. start + 4v + 3 of row i
        return [(i, start + 4 * v + e) for v in range(8) for i in rows for e in range(4)]

    if ggml_type == GGML_Q6_K:
        order = [(i, 208 + e) for i in rows for e in range(2)]
        order += [(i, 192 + s) for s in range(16) for i in rows]
        order += [p for h in range(2) for c in range(2) for p in vectors(64 * h + 32 * c)]
        order += [p for h in range(2) for p in vectors(128 + 32 * h)]
    else:
        order = [(i, 0 + e) for i in rows for e in range(2)] + [(i, 2 + e) for i in rows for e in range(2)]
        order += [(i, 4 + s) for s in range(8) for i in rows] + [(i, 12 + s) for s in range(8) for i in rows]
        if ggml_type == GGML_Q5_K:
            order += vectors(20)
        order += [p for g in range(4) for p in vectors(wide - 128 + 32 * g)]
    index = torch.tensor([i * wide + byte for i, byte in order])
    assert sorted(index.tolist()) == list(range(TILE_ROWS * wide)), "the tile layout must be a permutation"
    return index


def _kquant_pack(weight: QuantizedWeight) -> PackedWeight:
    n, k = weight.shape
    sbs, ggml_type = k // SUPER_BLOCK, weight.ggml_type
    padded = -(-n // TILE_ROWS) * TILE_ROWS
    blocks = torch.zeros(padded, sbs, BLOCK_BYTES[ggml_type], dtype=torch.uint8)
    blocks[:n] = weight.data.view(n, sbs, -1)
    wide = _widen(blocks, ggml_type).view(padded // TILE_ROWS, TILE_ROWS, sbs, -1).permute(0, 2, 1, 3)
    tiles = wide.reshape(padded // TILE_ROWS, sbs, -1)[..., _kquant_tile_order(ggml_type)]
    return PackedWeight(ggml_type, tiles.reshape(padded // TILE_ROWS, -1).contiguous(), weight.shape)


def _kquant_unpack(packed: PackedWeight) -> QuantizedWeight:
    n, k = packed.shape
    sbs, ggml_type = k // SUPER_BLOCK, packed.ggml_type
    tiles = packed.tiles.view(-1, sbs, packed.tiles.shape[1] // sbs)
    wide = tiles[..., torch.argsort(_kquant_tile_order(ggml_type))].view(-1, sbs, TILE_ROWS, tiles.shape[-1] // 8)
    rows = _narrow(wide.permute(0, 2, 1, 3), ggml_type).reshape(-1, sbs * BLOCK_BYTES[ggml_type])
    return QuantizedWeight(ggml_type, rows[:n].contiguous(), packed.shape)
