"""Correctness helpers shared by every project's test_correctness.py.

- Inputs are fresh random tensors, seeded per case, never zeros (a zero input hides a missing scale).
- Outputs are poisoned (NaN, or a sentinel for integers) before a kernel writes them, so an element the
  kernel forgot to write fails the comparison instead of passing by accident.
- Results are compared with a float64 reference by relative L2 error *and* max-abs error, with
  per-dtype tolerances that follow each format's unit roundoff.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .env import interpreter_active

# (relative L2, max-abs relative to the reference's max magnitude) per output dtype, for elementwise or
# row-reduction kernels that compute in fp32. Matmul-like kernels scale these with sqrt(K).
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (8e-3, 1.6e-2),
}


def case_seed(*parts) -> int:
    """A stable seed derived from a test case's parameters: each case gets its own random inputs."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(seed)
    return g


def randn(shape, dtype: torch.dtype, device, seed: int, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
    """Standard normal values (never all zero), drawn on CPU for device-independent inputs."""
    g = generator(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32) * scale + offset
    return x.to(dtype=dtype, device=device)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill `t` with a value no correct kernel produces (NaN for floats, a large sentinel for ints)."""
    if t.dtype.is_floating_point:
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            t.view(torch.uint8).fill_(0x7F)  # NaN in e4m3fn
        else:
            t.fill_(float("nan"))
    else:
        t.fill_(torch.iinfo(t.dtype).max if t.dtype != torch.bool else True)
    return t


def empty_poisoned(shape, dtype, device) -> torch.Tensor:
    return poison(torch.empty(shape, dtype=dtype, device=device))


@dataclass
class ErrorReport:
    rel_l2: float
    max_abs: float
    ref_max: float
    nonfinite: int

    def __str__(self) -> str:
        return (f"rel_l2={self.rel_l2:.3e} max_abs={self.max_abs:.3e} (ref max |x| {self.ref_max:.3e}), "
                f"non-finite={self.nonfinite}")


def error_report(actual: torch.Tensor, reference: torch.Tensor) -> ErrorReport:
    a = actual.detach().to("cpu", torch.float64)
    r = reference.detach().to("cpu", torch.float64)
    if a.shape != r.shape:
        raise AssertionError(f"shape mismatch: got {tuple(a.shape)}, reference {tuple(r.shape)}")
    nonfinite = int((~torch.isfinite(a) & torch.isfinite(r)).sum())
    diff = (a - r).nan_to_num(nan=float("inf"))
    if a.numel() == 0:
        return ErrorReport(0.0, 0.0, 0.0, 0)
    rel_l2 = float(diff.norm() / r.norm().clamp_min(1e-30))
    return ErrorReport(rel_l2, float(diff.abs().max()), float(r.abs().max()), nonfinite)


def assert_close(
    actual: torch.Tensor,
    reference: torch.Tensor,
    dtype: torch.dtype | None = None,
    *,
    rel_l2: float | None = None,
    max_abs: float | None = None,
    scale: float = 1.0,
    msg: str = "",
) -> ErrorReport:
    """Compare with a float64 reference. Tolerances default to TOLERANCES[dtype] times `scale`;
    max_abs is relative to the reference's largest magnitude unless given explicitly."""
    dtype = dtype or actual.dtype
    tol_l2, tol_abs = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    report = error_report(actual, reference)
    limit_l2 = rel_l2 if rel_l2 is not None else tol_l2 * scale
    limit_abs = max_abs if max_abs is not None else tol_abs * scale * max(report.ref_max, 1.0)
    if report.nonfinite or report.rel_l2 > limit_l2 or report.max_abs > limit_abs:
        raise AssertionError(f"{msg} {report} exceeds rel_l2<={limit_l2:.1e}, max_abs<={limit_abs:.1e}".strip())
    return report


def bf16_casts_truncate() -> bool:
    """Triton's interpreter (3.9) converts fp32 -> bf16 by dropping the low 16 bits (round toward zero);
    compiled kernels round to nearest even. Tests that expect exact rounding relax to one ulp there."""
    return interpreter_active()


def assert_rounded_equal(actual: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> None:
    """`actual` must equal `exact` (float64) rounded once to `dtype`: bit-exact, except one ulp of bf16
    under the interpreter (see bf16_casts_truncate)."""
    expected = exact.to(dtype)
    a = actual.detach().cpu()
    e = expected.detach().cpu()
    if dtype == torch.bfloat16 and bf16_casts_truncate():
        ulp_distance = (a.view(torch.int16).int() - e.view(torch.int16).int()).abs()
        worst = int(ulp_distance.max()) if ulp_distance.numel() else 0
        assert worst <= 1, f"more than 1 bf16 ulp away: {worst}"
    else:
        assert torch.equal(a, e), f"not the once-rounded value: max diff {(a.double() - e.double()).abs().max()}"


def chi_square_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness of fit of sampled `tokens` to `probs` (the samplers' tests): cells of expected count
    below 5 are pooled into one; a drawn token of probability zero fails outright ("outside the kept set"),
    and a single possible outcome has nothing to fit (1.0)."""
    counts = torch.bincount(tokens.cpu().flatten(), minlength=probs.numel()).double()
    probs = probs.cpu().double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the kept set: {torch.nonzero(counts * ~support)}"
    expected = probs * tokens.numel()
    big = expected >= 5
    small = support & ~big
    observed = torch.cat([counts[big], counts[small].sum().reshape(1)])
    wanted = torch.cat([expected[big], expected[small].sum().reshape(1)])
    observed, wanted = observed[wanted > 0], wanted[wanted > 0]
    if observed.numel() < 2:
        return 1.0
    stat = float(((observed - wanted) ** 2 / wanted).sum())
    return float(torch.special.gammaincc(torch.tensor((observed.numel() - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


ISA_BUILDS = ("native", "avx2", "scalar")   # kernel_lab.ops.cpu_kernels.ISA_FLAGS' builds, widest first
# (conftest.py's `isa_build` fixture builds a CPU library for one of them)

