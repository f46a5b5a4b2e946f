"""Qwen2 / Qwen2.5: the Llama decoder with a bias on q, k and v."""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    family_name = "Qwen2, Qwen2.5"
    family_notes = "q/k/v bias"
    family_test = "test_families.py::test_family_matches_transformers[qwen2]"

    @classmethod
    def translate_config(cls, hf_config: dict) -> dict:
        refuse_layered_windows(hf_config)
        return {"qkv_bias": True, "sliding_window": None}


def refuse_layered_windows(hf_config: dict) -> None:
    """Qwen's `use_sliding_window` windows only the layers from `max_window_layers` on: not implemented."""
    if hf_config.get("use_sliding_window"):
        raise ValueError("unsupported use_sliding_window=true: Qwen's per-layer sliding windows "
                         "(max_window_layers) are not implemented")
