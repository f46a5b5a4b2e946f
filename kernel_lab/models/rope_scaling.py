"""RoPE inverse frequencies with Llama 3.1+ ("llama3") scaling, from a Hugging Face config or a GGUF file.

    inv_freq[i] = theta ** (-2i / dim)                      the unscaled frequencies, i < dim / 2
    wavelen     = 2 pi / inv_freq[i]
    llama3:       wavelen < L / high   -> inv_freq           (high frequencies kept)
                  wavelen > L / low    -> inv_freq / factor  (low frequencies slowed by `factor`)
                  otherwise            -> ((1 - s) / factor + s) * inv_freq,  s = (L / wavelen - low) / (high - low)
    with L = original_max_position_embeddings. This is transformers' `_compute_llama3_parameters`
    (modeling_rope_utils), computed in the same float32 order so the two agree bit for bit.

A GGUF file from llama.cpp's converter states none of these numbers: it stores the per-frequency divisors as
the tensor `rope_freqs` ([dim / 2] float32: 1, `factor`, or 1 / ((1 - s) / factor + s)), and llama.cpp
rotates by inv_freq / rope_freqs. `inv_freq_from_rope_freqs` is that; `llama3_parameters_from_rope_freqs`
recovers a config's `rope_parameters` from the tensor (for a config.json that transformers can read).
"""

from __future__ import annotations

import math

import torch

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def default_inv_freq(dim: int, rope_theta: float) -> torch.Tensor:
    """theta ** (-2i / dim) for i < dim / 2, float32, as transformers computes it."""
    if dim <= 0 or dim % 2:
        raise ValueError(f"the rotary dimension must be a positive even number, got {dim}")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    return 1.0 / (rope_theta ** exponents)


def llama3_inv_freq(dim: int, rope_theta: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1+ scaled inverse frequencies ([dim / 2] float32); see the module docstring."""
    if not factor > 0 or not 0 < low_freq_factor < high_freq_factor or original_max_position_embeddings <= 0:
        raise ValueError(f"llama3 rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
                         f"original_max_position_embeddings > 0; got factor={factor}, low_freq_factor="
                         f"{low_freq_factor}, high_freq_factor={high_freq_factor}, "
                         f"original_max_position_embeddings={original_max_position_embeddings}")
    inv_freq = default_inv_freq(dim, rope_theta)
    context = original_max_position_embeddings
    low_wavelen, high_wavelen = context / low_freq_factor, context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, slowed)


def inv_freq_from_config(config: dict, dim: int | None = None) -> torch.Tensor:
    """Inverse frequencies for a config.json dict: no scaling ("default") or "llama3"; anything else is
    refused by name (a silently unscaled RoPE would give wrong answers past the original context)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    if dim is None:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        dim = int(head_dim * params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if rope_type == "default":
        return default_inv_freq(dim, theta)
    if rope_type == "llama3":
        missing = [k for k in LLAMA3_KEYS if k not in params]
        if missing:
            raise ValueError(f"llama3 rope scaling is missing {missing} in the config's rope parameters")
        return llama3_inv_freq(dim, theta, float(params["factor"]), float(params["low_freq_factor"]),
                               float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    raise ValueError(f"rope type {rope_type!r} is not supported (supported: 'default', 'llama3')")


def _check_rope_freqs(rope_freqs: torch.Tensor, dim: int) -> torch.Tensor:
    if not isinstance(rope_freqs, torch.Tensor) or rope_freqs.shape != (dim // 2,):
        shape = tuple(rope_freqs.shape) if isinstance(rope_freqs, torch.Tensor) else type(rope_freqs).__name__
        raise ValueError(f"rope_freqs must be a tensor of shape ({dim // 2},) (the rotary dimension {dim} / 2), "
                         f"got {shape}")
    rope_freqs = rope_freqs.float()
    if not bool(torch.isfinite(rope_freqs).all()) or bool((rope_freqs <= 0).any()):
        raise ValueError("rope_freqs must hold positive finite divisors")
    return rope_freqs


def inv_freq_from_rope_freqs(dim: int, rope_theta: float, rope_freqs: torch.Tensor) -> torch.Tensor:
    """What llama.cpp rotates by for a GGUF with a `rope_freqs` tensor: the default frequencies divided by it."""
    return default_inv_freq(dim, rope_theta) / _check_rope_freqs(rope_freqs, dim)


def llama3_parameters_from_rope_freqs(dim: int, rope_theta: float, rope_freqs: torch.Tensor,
                                      rtol: float = 1e-5) -> dict:
    """The `rope_parameters` ("llama3") whose frequencies are the ones `rope_freqs` gives.

    `factor` is the divisor of the low frequencies. Between the two cut-offs the blend weight s is linear in
    1 / wavelen, s = (L / wavelen - low) / (high - low); its slope and intercept fix L / (high - low) and
    low / (high - low), and (L, low, high) scaled together give the same frequencies, so low_freq_factor is
    taken as 1 (Llama 3.1 and 3.2's value) and the rest follows. Needs two frequencies between the cut-offs;
    raises ValueError when there are fewer or the tensor is not a llama3 scaling at all."""
    divisors = _check_rope_freqs(rope_freqs, dim).double()
    inv_freq = default_inv_freq(dim, rope_theta).double()
    factor = float(divisors.max())
    if factor <= 1.0 or not torch.allclose(divisors.min(), torch.ones((), dtype=torch.float64), rtol=rtol):
        raise ValueError("rope_freqs is not a llama3 scaling: it needs divisors from 1 (high frequencies) up to "
                         f"the factor (low ones), got {float(divisors.min())} .. {factor}")
    medium = (divisors > 1.0 + rtol) & (divisors < factor * (1 - rtol))
    if int(medium.sum()) < 2:
        raise ValueError(f"rope_freqs has {int(medium.sum())} frequencies between llama3's cut-offs; two are "
                         "needed to recover its parameters")
    smooth = (1.0 / divisors[medium] - 1.0 / factor) / (1.0 - 1.0 / factor)
    x = inv_freq[medium] / (2 * math.pi)                                         # 1 / wavelen
    slope, intercept = torch.linalg.lstsq(torch.stack([x, torch.ones_like(x)], 1), smooth[:, None]).solution[:, 0]
    low = 1.0
    high = round(low - low / float(intercept), 6)                                # intercept = -low / (high - low)
    context = float(slope) * (high - low)
    params = {"rope_type": "llama3", "rope_theta": float(rope_theta), "factor": factor, "low_freq_factor": low,
              "high_freq_factor": high, "original_max_position_embeddings": round(context)}
    if abs(context - round(context)) > 1e-3 * context:
        raise ValueError(f"rope_freqs does not fit a llama3 scaling (recovered original context {context:.3f})")
    rebuilt = llama3_inv_freq(dim, rope_theta, factor, low, high, round(context)).double()
    if not torch.allclose(rebuilt, inv_freq / divisors, rtol=rtol, atol=0.0):
        raise ValueError("rope_freqs does not fit a llama3 scaling: the recovered parameters do not reproduce it")
    return params
