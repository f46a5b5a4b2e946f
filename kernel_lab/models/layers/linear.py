"""The weight layouts a projection can have, chosen at load: `Linear` (float32 or half; on CPU with a copy in
oneDNN's blocked layout), `QuantizedLinear` (GGUF blocks, the C kernel of ops/gguf_linear.py) and
`Embedding` (either form, read row by row). `linear_for` picks one for a row-stacked weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernel_lab.ops.gguf_linear import PackedWeight, QuantizedWeight, dequantize_rows, gguf_linear, pack, pack_stacked


def param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


# The row count oneDNN's blocked layout is chosen for. A/B runs of the model's projection shapes gave about the
# same speed for hints 2..32 at 2..512 rows; any hint >= 2 gives the blocked (not the row-major) layout.
BLOCKED_ROWS_HINT = 8


def _onednn_blocked_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` reordered once into oneDNN's blocked layout, or None where that path does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BLOCKED_ROWS_HINT)
    except (RuntimeError, AttributeError):  # a torch build without the op: F.linear everywhere
        return None


class Linear(nn.Module):
    """y = x @ weight.T (+ bias), weight [out, in] (it may stack several projections' rows).

    CUDA: F.linear. CPU, float32: a single row runs MKL's GEMV on the row-major weight; two or more rows run
    oneDNN on a copy of the weight reordered once, at load, into oneDNN's blocked layout (vLLM's CPU
    backend also prepacks with oneDNN). In A/B runs of the model's shapes on one core, the blocked copy was
    faster from 2 rows up and slower for a single row, whose GEMV only streams the weight once
    (projects/09_engine/README.md). The price is a second copy of each projection weight on CPU.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else param(weight)
        self.bias = None if bias is None else param(bias)
        self.blocked = _onednn_blocked_weight(self.weight)   # not a buffer: an opaque oneDNN tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked is None or x.shape[0] < 2:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.blocked, self.bias, "none", [], "")


class QuantizedLinear(nn.Module):
    """y = x @ W.T (+ bias) with W in GGUF blocks, packed once into the kernel's 8-row tiles
    (ops/gguf_linear.py). CPU, float32 activations."""

    def __init__(self, weight: QuantizedWeight | PackedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.packed = pack(weight) if isinstance(weight, QuantizedWeight) else weight
        self.bias = None if bias is None else param(bias)

    @property
    def weight_bytes(self) -> int:
        return self.packed.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gguf_linear(x, self.packed, self.bias, validate=False)


class Embedding(nn.Module):
    """Rows of the token table: float32 (`table`), or GGUF blocks dequantized row by row (`packed`)."""

    def __init__(self, table: torch.Tensor | QuantizedWeight):
        super().__init__()
        if isinstance(table, QuantizedWeight):
            self.packed, self.table = pack(table), None
        else:
            self.packed, self.table = None, table if isinstance(table, nn.Parameter) else param(table)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return F.embedding(ids, self.table)
        return dequantize_rows(self.packed, ids)


def linear_for(parts: list, bias: torch.Tensor | None = None) -> nn.Module:
    """One layer for the row-stacked `parts`: QuantizedLinear when all are GGUF blocks (of several formats: a
    PackedStack), else a float32 `Linear` (GGUF blocks mixed with float weights are dequantized)."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return QuantizedLinear(pack_stacked(parts) if len(parts) > 1 else parts[0], bias)
    dense = [p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts]
    return Linear(torch.cat(dense) if len(dense) > 1 else dense[0], bias)


def weight_bytes(layer: nn.Module) -> int:
    """Bytes of weights a forward pass of `layer` reads."""
    layer = getattr(layer, "base_layer", layer)  # a LoRALinear (engine/lora.py): its base weight
    if isinstance(layer, QuantizedLinear):
        return layer.weight_bytes
    return layer.weight.numel() * layer.weight.element_size()
