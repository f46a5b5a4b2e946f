"""Qwen3: the Llama decoder with an explicit head_dim and an RMSNorm over each q and k head before RoPE
(`q_norm`, `k_norm`; applied on the qkv buffer, so the fused CPU decode call reads normalised heads)."""

from __future__ import annotations

from .llama import LlamaForCausalLM
from .qwen2 import refuse_layered_windows


class Qwen3ForCausalLM(LlamaForCausalLM):
    family_name = "Qwen3"
    family_notes = "per-head q/k RMSNorm before RoPE, explicit head_dim"
    family_test = "test_families.py::test_family_matches_transformers[qwen3]"

    @classmethod
    def translate_config(cls, hf_config: dict) -> dict:
        refuse_layered_windows(hf_config)
        return {"qk_norm": True, "sliding_window": None}
