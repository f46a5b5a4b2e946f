"""Gemma (1): the Llama decoder with GeGLU (tanh GELU), RMSNorms that scale by (1 + w) (folded into w at
load), embeddings multiplied by sqrt(hidden_size), head_dim 256 and the lm_head tied to the embedding."""

from __future__ import annotations

from .llama import LlamaForCausalLM

# transformers' activation names -> ours: tanh GELU (what Gemma was trained with) or the exact erf form
GELUS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}


class GemmaForCausalLM(LlamaForCausalLM):
    family_name = "Gemma"
    family_notes = "GeGLU (tanh), (1 + w) norms folded at load, sqrt(hidden) embedding scale, head_dim 256"
    family_test = "test_families.py::test_family_matches_transformers[gemma]"

    @classmethod
    def translate_config(cls, hf_config: dict) -> dict:
        act = hf_config.get("hidden_act") or "gelu_pytorch_tanh"  # the one transformers' GemmaMLP reads
        if act not in GELUS:
            raise ValueError(f"unsupported hidden_act {act!r} for Gemma (supported: {', '.join(GELUS)})")
        return {"hidden_act": GELUS[act], "norm_offset": True, "embed_scale": True,
                "tie_word_embeddings": bool(hf_config.get("tie_word_embeddings", True))}
