"""Which architectures load: the Hugging Face `architectures` name -> the family's file and class.

A family file holds a decoder class with `translate_config(hf_config) -> dict` (its ModelConfig fields, and
the refusal of anything it does not implement) and `family_row` (its line of the 09 README's table); the
decoder itself is the shared one of llama.py, configured by those fields. vLLM keeps the same split.
"""

from __future__ import annotations

import importlib

# name -> "module:Class" under kernel_lab.models, imported on first use
ARCHITECTURES = {
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MistralForCausalLM": "mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "qwen3:Qwen3ForCausalLM",
    "GemmaForCausalLM": "gemma:GemmaForCausalLM",
    "Phi3ForCausalLM": "phi3:Phi3ForCausalLM",
    "MixtralForCausalLM": "mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "qwen2_moe:Qwen2MoeForCausalLM",
}
# names people will try, with what is missing: refused at load with this reason
REFUSED = {
    "Gemma2ForCausalLM": "Gemma 2's attention and final logit softcapping and its alternating sliding-window "
                         "layers are not implemented",
    "Gemma3ForCausalLM": "Gemma 3's per-layer sliding windows and local RoPE base are not implemented",
    "Qwen3MoeForCausalLM": "Qwen3-MoE is not implemented",
}


def model_class(architecture: str):
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    module, name = ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(f"kernel_lab.models.{module}"), name)


def family_of(hf_config: dict) -> tuple[str, type]:
    """(architecture, decoder class) for a config.json, or a ValueError naming the architecture and why it
    is refused."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch, model_class(arch)
    refused = [a for a in archs if a in REFUSED]
    if refused:
        raise ValueError(f"unsupported model architecture {refused[0]!r}: {REFUSED[refused[0]]}")
    raise ValueError(f"unsupported model architecture {archs or hf_config.get('model_type')!r}; "
                     f"supported: {', '.join(ARCHITECTURES)}")


def family_table() -> str:
    """The 09 README's table of families, one row per registered architecture."""
    lines = ["| architecture | family | what differs from Llama | test |", "|---|---|---|---|"]
    for arch in ARCHITECTURES:
        cls = model_class(arch)
        lines.append(f"| `{arch}` | {cls.family_name} | {cls.family_notes} | `{cls.family_test}` |")
    return "\n".join(lines)
