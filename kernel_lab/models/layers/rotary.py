"""Rotary position embedding: the per-pair frequencies (with Llama 3 and linear scaling), the cos/sin table
and the rotation itself (neox style, "rotate half")."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotary frequencies, computed as transformers computes them (so fp32 results match)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(
            scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {scaling!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Neox-style ("rotate half") RoPE with a precomputed cos/sin table indexed by position."""

    def __init__(self, config: ModelConfig, max_positions: int, device):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * rope_inv_freq(config)[None, :]       # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)                           # [P, D]
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] of the batch's positions: looked up once per forward, used by every layer."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> a rotated copy (computed in fp32, returned in x's dtype)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
