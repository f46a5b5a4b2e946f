"""Project 06's keyed randomness on the CPU, bit for bit: Triton's Philox4x32-10 (`tl.randint4x`) written with
torch int64 arithmetic, and the race variates of `sampling._exponential_at` (counter `(round << 32) |
index // 4`, output word `index % 4`). The speculative op's float64 reference and its CPU path draw from it,
so they consume exactly the random words its Triton kernel consumes, and the same per-position seeds give
the same tokens on the CPU as on the GPU (up to float32 rounding of the probabilities); a test pins the
two streams together.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85      # Weyl increments of the key (Triton's 32-bit constants)
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57  # round multipliers
_ROUNDS = 10
ACCEPT_ROUND = 0x7FFFFFFF  # counter high half of the acceptance uniform; the race uses round 0


def _mul_hi_lo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of a * b for a in [0, 2**32) (int64) and a 32-bit constant b: b is split in
    16-bit halves so every partial product stays below 2**49 and int64 never overflows."""
    lo_part = a * (b & 0xFFFF)
    mid = a * (b >> 16) + (lo_part >> 16)
    return mid >> 16, ((mid & 0xFFFF) << 16) | (lo_part & 0xFFFF)


def philox4x32(seed: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`tl.randint4x(seed, offset)` for int64 `seed` and `offset` (broadcast together): four words, each an
    int64 tensor in [0, 2**32)."""
    seed, offset = torch.broadcast_tensors(seed.to(torch.int64), offset.to(torch.int64))
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    c0, c1 = offset & _M32, (offset >> 32) & _M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(c2, _ROUND_B)
        hi_a, lo_a = _mul_hi_lo(c0, _ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _M32
        k1 = (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """The kernels' uniform of a 32-bit word, (23 high bits + 0.5) / 2**23, strictly inside (0, 1) and exact
    in float32 and float64 alike."""
    return ((bits >> 9).double() + 0.5) * (1.0 / (1 << 23))


def race_exponentials(seed: torch.Tensor, vocab: int, round_id: int = 0) -> torch.Tensor:
    """Exp(1) variates -log(u) of tokens 0 .. vocab - 1 for each seed: float64 [len(seed), vocab]."""
    quads = torch.arange((vocab + 3) // 4, dtype=torch.int64)
    words = philox4x32(seed.reshape(-1, 1), (round_id << 32) | quads[None, :])
    bits = torch.stack(words, dim=-1).reshape(seed.numel(), -1)[:, :vocab]
    return -torch.log(uniform_from_bits(bits))


def accept_uniform(seed: torch.Tensor) -> torch.Tensor:
    """The acceptance uniform of each seed (word 0 of counter ACCEPT_ROUND << 32): float64 like `seed`."""
    return uniform_from_bits(philox4x32(seed, torch.tensor(ACCEPT_ROUND << 32))[0])
