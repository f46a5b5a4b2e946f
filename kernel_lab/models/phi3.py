"""Phi-3: the Llama decoder from a checkpoint that stores q|k|v as one `qkv_proj` and gate|up as one
`gate_up_proj`, the layout our layers hold, so they load as they are. Its head_dim (96 for mini) runs on
CPU and on CUDA, where the decode and KV-write kernels are instantiated for it (kernel_lab/ops/kv_cache.py,
SUPPORTED_HEAD_DIMS) and the prefill is SDPA, which takes any head_dim."""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    family_name = "Phi-3"
    family_notes = "fused qkv_proj and gate_up_proj in the checkpoint, head_dim 96 (CPU and CUDA)"
    family_test = "test_families.py::test_family_matches_transformers[phi3]"

    @classmethod
    def translate_config(cls, hf_config: dict) -> dict:
        return {"fused_projections": True}
