"""Request defaults from generation_config.json (kernel_lab/engine/generation_defaults.py, vLLM's
`--generation-config auto|vllm`) and the documented sampling defaults of `kernel-lab generate` / `demo`."""

from __future__ import annotations

import json
import shutil

import pytest

from kernel_lab.cli import CLI_SAMPLING_DEFAULTS, build_parser, sampling_params
from kernel_lab.engine.generation_defaults import sampling_defaults

MODEL_CHOICES = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
                 "max_new_tokens": 64}


def _model_dir(tmp_path, generation: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_auto_takes_the_models_sampling_values_and_vllm_ignores_them(tmp_path):
    directory = _model_dir(tmp_path, {**MODEL_CHOICES, "do_sample": True, "eos_token_id": 2})
    want = {k: v for k, v in MODEL_CHOICES.items() if k != "max_new_tokens"} | {"max_tokens": 64}
    assert sampling_defaults(directory, "auto") == want
    assert sampling_defaults(directory, "vllm") == {}
    # Hugging Face's own defaults restated are not the model's choice (vLLM's to_diff_dict)
    _model_dir(tmp_path, {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0})
    assert sampling_defaults(directory, "auto") == {}
    assert sampling_defaults(tmp_path / "nowhere", "auto") == {} and sampling_defaults(None, "auto") == {}
    with pytest.raises(ValueError, match="generation_config must be one of"):
        sampling_defaults(directory, "model")
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="not readable JSON"):
        sampling_defaults(directory, "auto")


def test_engine_config_reads_them_for_the_model(bundled_model, tmp_path):
    from kernel_lab.engine.config import EngineConfig
    from kernel_lab.models.loader import resolve_model_dir

    directory = tmp_path / "model"
    shutil.copytree(resolve_model_dir(None, float_weights=False), directory)
    _model_dir(directory, {"temperature": 0.3, "max_new_tokens": 7})
    assert EngineConfig(model=str(directory), device="cpu").sampling_defaults == {"temperature": 0.3, "max_tokens": 7}
    assert EngineConfig(model=str(directory), device="cpu", generation_config="vllm").sampling_defaults == {}


def _args(*flags):
    return build_parser(["generate"]).parse_args(["generate", "hi", *flags])


def test_cli_flags_beat_greedy_beat_the_model_beats_the_documented_defaults():
    params = sampling_params(_args())
    assert (params.temperature, params.top_p, params.repetition_penalty, params.seed, params.max_tokens) == (
        CLI_SAMPLING_DEFAULTS["temperature"], CLI_SAMPLING_DEFAULTS["top_p"],
        CLI_SAMPLING_DEFAULTS["repetition_penalty"], 0, 256)
    model = {"temperature": 0.3, "max_tokens": 9}
    params = sampling_params(_args(), model)
    assert params.temperature == 0.3 and params.max_tokens == 9
    params = sampling_params(_args("--greedy"), model)
    assert params.greedy and params.repetition_penalty == 1.0 and params.max_tokens == 9
    params = sampling_params(_args("--greedy", "--repetition-penalty", "1.3", "--max-tokens", "4"), model)
    assert params.greedy and params.repetition_penalty == 1.3 and params.max_tokens == 4
    assert sampling_params(_args("--temperature", "0")).greedy


@pytest.mark.usefixtures("one_cpu_thread")
def test_llm_without_sampling_params_uses_the_models_defaults(bundled_model, reference_only):
    from kernel_lab.engine import LLM

    llm = LLM(device="cpu", max_model_len=256)
    assert llm.engine.config.sampling_defaults == {}  # the bundled GGUF's generation_config sets no sampling
    llm.engine.config.sampling_defaults = {"max_tokens": 3, "temperature": 0.0}
    (out,) = llm.generate("The capital of France is")
    assert len(out.outputs[0].token_ids) == 3
    assert len("".join(llm.stream("The capital of France is"))) > 0
    assert llm.get_default_sampling_params().greedy
