"""Llama 3.1+ RoPE scaling (kernel_lab/models/rope_scaling.py) against transformers' llama3 rope init, and
the GGUF `rope_freqs` tensor as llama.cpp's converter writes it."""

from __future__ import annotations

import math

import pytest
import torch

from kernel_lab.models.rope_scaling import (
    default_inv_freq,
    inv_freq_from_config,
    inv_freq_from_rope_freqs,
    llama3_inv_freq,
    llama3_parameters_from_rope_freqs,
)

# (head_dim, theta, factor, low, high, original context): Llama 3.1 8B, Llama 3.2 1B/3B, and an unusual one
LLAMA3_CASES = [(128, 500000.0, 8.0, 1.0, 4.0, 8192), (64, 500000.0, 32.0, 1.0, 4.0, 8192),
                (96, 10000.0, 4.0, 2.0, 8.0, 2048)]


def transformers_inv_freq(head_dim, theta, factor, low, high, context):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=4 * context,
        rope_parameters={"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
                         "high_freq_factor": high, "original_max_position_embeddings": context})
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert attention_scaling == 1.0
    return inv_freq


def converter_rope_freqs(head_dim, theta, factor, low, high, context):
    """The rope_freqs tensor as llama.cpp's convert_hf_to_gguf.py describes it, written from its formula:
    per frequency 1 (high), factor (low), 1 / ((1 - s) / factor + s) between."""
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < context / high:
            divisors.append(1.0)
        elif wavelen > context / low:
            divisors.append(factor)
        else:
            s = (context / wavelen - low) / (high - low)
            divisors.append(1.0 / ((1 - s) / factor + s))
    return torch.tensor(divisors, dtype=torch.float32)


@pytest.mark.parametrize("case", LLAMA3_CASES)
def test_llama3_matches_transformers_bit_for_bit(case):
    ours = llama3_inv_freq(*case)
    expected = transformers_inv_freq(*case)
    assert ours.dtype == torch.float32 and torch.equal(ours, expected)
    assert not torch.equal(ours, default_inv_freq(case[0], case[1])), "the case must scale something"
    config = {"hidden_size": 4 * case[0], "num_attention_heads": 4, "head_dim": case[0], "rope_parameters": {
        "rope_type": "llama3", "rope_theta": case[1], "factor": case[2], "low_freq_factor": case[3],
        "high_freq_factor": case[4], "original_max_position_embeddings": case[5]}}
    assert torch.equal(inv_freq_from_config(config), expected)


@pytest.mark.parametrize("case", LLAMA3_CASES)
def test_gguf_rope_freqs_give_transformers_frequencies(case):
    head_dim, theta = case[:2]
    rope_freqs = converter_rope_freqs(*case)
    medium = int(((rope_freqs > 1) & (rope_freqs < case[2])).sum())
    assert medium >= 2 and bool((rope_freqs == 1).any()) and bool((rope_freqs == case[2]).any())
    expected = transformers_inv_freq(*case)
    torch.testing.assert_close(inv_freq_from_rope_freqs(head_dim, theta, rope_freqs), expected, rtol=2e-6, atol=0)
    params = llama3_parameters_from_rope_freqs(head_dim, theta, rope_freqs)
    scale = case[3]  # (L, low, high) are recovered up to a common scale, with low_freq_factor 1
    assert params["factor"] == case[2] and params["low_freq_factor"] == 1.0
    assert params["high_freq_factor"] == pytest.approx(case[4] / scale, rel=1e-6)
    assert params["original_max_position_embeddings"] == round(case[5] / scale)
    rebuilt = inv_freq_from_config({"head_dim": head_dim, "rope_parameters": params})
    torch.testing.assert_close(rebuilt, expected, rtol=2e-6, atol=0)


def test_default_and_bad_inputs():
    config = {"hidden_size": 256, "num_attention_heads": 4, "rope_theta": 10000.0}
    torch.testing.assert_close(inv_freq_from_config(config), 10000.0 ** (-torch.arange(0, 64, 2) / 64.0))
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        inv_freq_from_config({**config, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="missing"):
        inv_freq_from_config({**config, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match=r"rope_freqs must be a tensor of shape \(64,\)"):
        inv_freq_from_rope_freqs(128, 5e5, torch.ones(32))
    with pytest.raises(ValueError, match="positive finite"):
        inv_freq_from_rope_freqs(128, 5e5, torch.zeros(64))
    with pytest.raises(ValueError, match="not a llama3 scaling"):
        llama3_parameters_from_rope_freqs(128, 5e5, torch.ones(64))
    noisy = converter_rope_freqs(*LLAMA3_CASES[0])
    noisy[30] *= 1.01
    with pytest.raises(ValueError, match="does not fit a llama3 scaling"):
        llama3_parameters_from_rope_freqs(128, 5e5, noisy)
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        llama3_inv_freq(128, 5e5, 8.0, 4.0, 1.0, 8192)
