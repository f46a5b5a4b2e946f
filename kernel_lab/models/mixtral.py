"""Mixtral: the Llama decoder with a sparse MLP, the top-k of `num_local_experts` experts per token on
project 07's `ops.moe` (llama.MixtureOfExperts), and Mistral's sliding window where config.json sets one."""

from __future__ import annotations

from .llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    family_name = "Mixtral"
    family_notes = "top-k of several experts per token through `ops.moe` (routing, grouped GEMM, combine)"
    family_test = "test_families.py::test_family_matches_transformers[mixtral]"

    @classmethod
    def translate_config(cls, hf_config: dict) -> dict:
        experts, top_k = int(hf_config["num_local_experts"]), int(hf_config["num_experts_per_tok"])
        if not 1 <= top_k <= experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_local_experts={experts}]")
        return {"num_experts": experts, "experts_per_token": top_k}
