"""What every op shares: `use_triton` (whether a tensor goes to a Triton kernel: on CUDA, or on the CPU under
TRITON_INTERPRET=1, read at call time) and the input checks and views. Which path each op takes on which
device is the dispatch rule of docs/architecture.md, "The dispatch rule"; each op's docstring states its own.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kernel_lab.harness.env import interpreter_active

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def use_triton(t: torch.Tensor) -> bool:
    """True when `t` should go to a Triton kernel (on the GPU, or through the interpreter on CPU)."""
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and interpreter_active()


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | None = None,
    min_ndim: int | None = None,
) -> torch.Tensor:
    """Raise TypeError/ValueError naming `name` if `t` is not a tensor of the expected dtype and rank."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype in ({_names(dtypes)}), got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}")
    return t


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All non-None tensors must live on one device; returns it."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for n, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{n} is on {t.device} but {first_name} is on {first.device}; all must share a device")
    return first.device


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride 1), got strides {t.stride()}")


def check_out(name: str, out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
    """Validate a caller-provided output buffer."""
    if out is None:
        return
    check_tensor(name, out, dtypes=(dtype,))
    check_shape(name, out, shape)
    if out.device != device:
        raise ValueError(f"{name} is on {out.device}, expected {device}")


def rows_view(x: torch.Tensor, unit_stride: bool = False) -> torch.Tensor | None:
    """View `x[..., H]` as 2-D `[rows, H]` without copying (with unit stride in H if `unit_stride`), or None
    where no such view exists (then the caller copies, or takes another path)."""
    if x.dim() == 0:
        return None
    if x.dim() != 2:
        try:
            x = x.view(-1, x.shape[-1])
        except RuntimeError:
            return None
    if unit_stride and x.stride(-1) != 1 and x.shape[-1] > 1:
        return None
    return x


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """`x[..., H]` as `[rows, H]` with unit stride in H: a view where one exists, else a copy."""
    view = rows_view(x, unit_stride=True)
    return view if view is not None else x.contiguous().view(-1, x.shape[-1])
