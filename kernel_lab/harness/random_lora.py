"""Random PEFT LoRA adapters for a Llama-shaped model, written in PEFT's layout (keys
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`, [r, in] and [out, r]): what the LoRA
tests and the serving benchmark load, so both read the same format a fine-tune would ship."""

from __future__ import annotations

import json

import torch


def module_shapes(hf: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each PEFT target module (Phi-3's stacked qkv_proj and gate_up_proj too)."""
    h, inter = hf["hidden_size"], hf["intermediate_size"]
    head = hf.get("head_dim") or h // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * head, hf["num_key_value_heads"] * head
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h), "qkv_proj": (h, q + 2 * kv),
            "gate_up_proj": (h, 2 * inter)}


def parent(module: str) -> str:
    return "mlp" if module in ("gate_proj", "up_proj", "down_proj", "gate_up_proj") else "self_attn"


def write_adapter(directory, hf: dict, rank: int, alpha, use_rslora: bool, modules, seed: int, **extra) -> dict:
    """A random PEFT LoRA adapter (nonzero A and B) in `directory`; returns its tensors."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes, tensors = module_shapes(hf), {}
    for i in range(hf["num_hidden_layers"]):
        for m in modules:
            fan_in, fan_out = shapes[m]
            key = f"base_model.model.model.layers.{i}.{parent(m)}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * fan_in ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.6 * rank ** -0.5
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": use_rslora,
              "target_modules": list(modules), "bias": "none", "use_dora": False, "fan_in_fan_out": False,
              "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "task_type": "CAUSAL_LM", **extra}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return tensors
