"""Request defaults from the model's generation_config.json, as vLLM's `--generation-config` gives them.

`auto` (vLLM's default): the sampling values the model's authors set (temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens as max_tokens) become the defaults of every request that does not
set them. `vllm`: the file is ignored and the neutral defaults of SamplingParams apply. As in vLLM
(`ModelConfig.get_diff_sampling_param`), only values that differ from Hugging Face's own generation
defaults count: a file that restates `top_k: 50` or `temperature: 1.0` changes nothing.

Where they apply: the server's requests (a field the request leaves out), `LLM.generate` / `chat` /
`stream` called without SamplingParams, and `kernel-lab generate` / `demo` for a flag not given.
"""

from __future__ import annotations

import json
from pathlib import Path

GENERATION_CONFIG_CHOICES = ("auto", "vllm")
# Hugging Face's GenerationConfig defaults: a value equal to one of them is not the model's choice
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0,
                "max_new_tokens": None}
_AS_SAMPLING_PARAM = {"max_new_tokens": "max_tokens"}


def sampling_defaults(model_dir: Path | None, mode: str = "auto") -> dict:
    """{SamplingParams field: value} the model's generation_config.json sets (empty for `vllm`, for a model
    without the file, or for a random-weight model). ValueError for an unknown mode or a malformed file."""
    if mode not in GENERATION_CONFIG_CHOICES:
        raise ValueError(f"generation_config must be one of {GENERATION_CONFIG_CHOICES}, got {mode!r}")
    path = None if model_dir is None else Path(model_dir) / "generation_config.json"
    if mode == "vllm" or path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{str(path)!r} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object")
    return {_AS_SAMPLING_PARAM.get(name, name): config[name] for name, default in _HF_DEFAULTS.items()
            if config.get(name) is not None and config[name] != default}
