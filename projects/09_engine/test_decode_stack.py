"""The fused CPU decode step's layers as one C call (kernel_lab/models/decode_stack.py) leave the model's
final hidden states bit-identical to the DecoderLayer loop's, prompt steps and decode steps alike, at one
and two kernel threads, on float32, float16, bfloat16, int8 and fp8 KV pages; a step with LoRA rows takes
the stack too (kl_lora_bgmv after each projection, as each LoRALinear's add_lora in the loop), and so does a
LoRA engine's base-only step."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kernel_lab.engine import LoRARequest, SamplingParams
from kernel_lab.engine.llm_engine import LLMEngine
from kernel_lab.models import decode_stack

pytestmark = pytest.mark.usefixtures("one_cpu_thread", "bundled_model")

STEPS = 3


def _engine(kv_cache_dtype="auto", lora: bool = False, input_len: int = 16) -> LLMEngine:
    """The bundled model (quantized weights, float32 activations) with one request admitted."""
    extra = dict(enable_lora=True, max_lora_rank=4) if lora else {}
    return LLMEngine(None, dtype="float32", device="cpu", weights="quantized", max_num_seqs=1,
                     enable_prefix_caching=False, max_model_len=input_len + 2 * STEPS + 16,
                     kv_cache_dtype=kv_cache_dtype, **extra)


def _hidden_states(monkeypatch, stack_on: bool, threads: int, kv_cache_dtype="auto", lora_request=None):
    """(the model's final hidden states of each step, how many steps took the stack)."""
    monkeypatch.setenv("KERNEL_LAB_DECODE_STACK", "1" if stack_on else "0")
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)   # the kernels' thread count outside a step
    engine = _engine(kv_cache_dtype, lora=lora_request is not None)
    prompt = [random.Random(0).randrange(1000, 20000) for _ in range(16)]
    engine.add_request("0", prompt, SamplingParams(temperature=0, max_tokens=2 * STEPS, ignore_eos=True),
                       lora_request=lora_request)
    model, seen, stacked = engine.runner.model, [], []
    forward, run = model.forward, decode_stack.run

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append(out.clone())
        return out

    def counting(*args, **kwargs):
        stacked.append(1)
        return run(*args, **kwargs)
    model.forward = recording
    monkeypatch.setattr(decode_stack, "run", counting)
    for _ in range(2 * STEPS):   # the prompt's steps, then decode steps
        engine.step()
    monkeypatch.setattr(decode_stack, "run", run)
    assert (decode_stack.plan(model) is not None) or not stack_on
    return seen, len(stacked)


@pytest.mark.parametrize("threads", [1, 2])
def test_stack_is_bit_identical_to_the_layer_loop(monkeypatch, threads):
    want, _ = _hidden_states(monkeypatch, False, threads)
    got, stacked = _hidden_states(monkeypatch, True, threads)
    assert len(got) == len(want) == stacked == 2 * STEPS
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g - w).abs().max()


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16", "int8", "fp8"])
def test_stack_is_bit_identical_on_every_kv_format(monkeypatch, kv_cache_dtype):
    want, _ = _hidden_states(monkeypatch, False, 1, kv_cache_dtype)
    got, stacked = _hidden_states(monkeypatch, True, 1, kv_cache_dtype)
    assert len(got) == len(want) == stacked == 2 * STEPS
    for g, w in zip(got, want):
        assert torch.equal(g, w), (kv_cache_dtype, (g - w).abs().max())


def _adapter(directory, config, seed: int = 5) -> LoRARequest:
    """A random rank-4 PEFT adapter on q_proj, v_proj and down_proj of every layer of `config`."""
    from safetensors.torch import save_file

    g, tensors = torch.Generator().manual_seed(seed), {}
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"self_attn.q_proj": (h, q), "self_attn.v_proj": (h, kv), "mlp.down_proj": (config.intermediate_size, h)}
    for i in range(config.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(4, fan_in, generator=g) * fan_in ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, 4, generator=g) * 0.5
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
         "bias": "none", "use_dora": False, "task_type": "CAUSAL_LM"}))
    return LoRARequest("stack-test", 1, str(directory))


@pytest.mark.usefixtures("reference_only")   # add_lora on CPU: its CPU path, not the interpreter
@pytest.mark.parametrize("threads", [1, 2])
def test_lora_rows_take_the_stack_with_the_layer_loops_bits(monkeypatch, tmp_path, threads):
    pytest.importorskip("safetensors")
    request = _adapter(tmp_path / "adapter", _engine().runner.model.config)
    want, _ = _hidden_states(monkeypatch, False, threads, lora_request=request)
    got, stacked = _hidden_states(monkeypatch, True, threads, lora_request=request)
    assert stacked == len(got) == len(want) == 2 * STEPS
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g - w).abs().max()
    base, _ = _hidden_states(monkeypatch, False, 1)
    assert not torch.equal(want[-1], base[-1])   # the adapter changes the hidden states: it was applied
    _, stacked = _hidden_states(monkeypatch, True, 1)
    assert stacked == 2 * STEPS
    # a LoRA engine's base-model request: no LoRA rows, so the stack, through the LoRALinears' base layers
    monkeypatch.setenv("KERNEL_LAB_DECODE_STACK", "1")
    engine = _engine(lora=True)
    engine.add_request("0", [1000 + i for i in range(16)], SamplingParams(temperature=0, max_tokens=4,
                                                                          ignore_eos=True))
    calls = []
    run = decode_stack.run
    monkeypatch.setattr(decode_stack, "run", lambda *a, **k: calls.append(1) or run(*a, **k))
    for _ in range(4):
        engine.step()
    assert calls and engine.runner.model.lora_manager is not None


def test_stack_applies_to_the_bundled_model_only_when_on(monkeypatch):
    monkeypatch.setenv("KERNEL_LAB_DECODE_STACK", "1")
    engine = _engine()
    assert decode_stack.plan(engine.runner.model) is not None
    monkeypatch.setenv("KERNEL_LAB_DECODE_STACK", "0")
    assert not decode_stack.enabled()
