"""Qwen-MoE (Qwen1.5-MoE, Qwen2-MoE): Qwen2's attention (q/k/v bias) with a sparse MLP on every layer: the
top-k of `num_experts` routed experts through project 07's `ops.moe` (weights left as softmax probabilities
where `norm_topk_prob` is false, as in Qwen1.5-MoE) plus a shared expert on every token, scaled by
sigmoid(shared_expert_gate(x)) (llama.MixtureOfExperts)."""

from __future__ import annotations

from .llama import LlamaForCausalLM
from .qwen2 import refuse_layered_windows


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    family_name = "Qwen1.5-MoE, Qwen2-MoE"
    family_notes = ("q/k/v bias; top-k routed experts through `ops.moe` (not renormalised where "
                    "`norm_topk_prob` is false) plus a sigmoid-gated shared expert")
    family_test = "test_families.py::test_family_matches_transformers[qwen_moe]"

    @classmethod
    def translate_config(cls, hf_config: dict) -> dict:
        refuse_layered_windows(hf_config)
        experts, top_k = int(hf_config["num_experts"]), int(hf_config["num_experts_per_tok"])
        if not 1 <= top_k <= experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_experts={experts}]")
        if hf_config.get("mlp_only_layers") or int(hf_config.get("decoder_sparse_step", 1)) != 1:
            raise ValueError("unsupported mlp_only_layers / decoder_sparse_step: Qwen-MoE's dense layers between "
                             "sparse ones are not implemented (every layer must be sparse)")
        return {"qkv_bias": True, "sliding_window": None, "num_experts": experts, "experts_per_token": top_k,
                "renormalize_experts": bool(hf_config.get("norm_topk_prob", False)),
                "expert_intermediate_size": int(hf_config["moe_intermediate_size"]),
                "shared_expert_intermediate_size": int(hf_config["shared_expert_intermediate_size"])}
