"""The engine on the GGUF's quantized weights (weights="quantized"), end to end on the bundled SmolLM2.

- memory: the resident weights stay within 1.2x the GGUF file's tensor bytes, and a decode step reads
  under a fifth of the fp32 path's bytes;
- logits: the fp32 path runs the same dequantized weights, so the two differ only by the int8 activations.
  On these prompts the log-probabilities of fp32's five most likely tokens move by at most 0.36 (measured);
  the bound here is 0.6, and the most likely token is the same wherever fp32's top-2 margin exceeds 0.6;
- batch invariance: a request's logits are bit-identical alone, batched with others, split into prefill
  chunks, and after another request filled the prefix cache. The int8 activations turn any 1-ulp difference
  upstream into a visible one, so this only holds because every op, attention included, computes a row from
  that row alone (model_runner.py: on CPU, prompt tokens attend through the paged decode kernel).
"""

from __future__ import annotations

import pytest
import torch

from kernel_lab.engine import LLMEngine, SamplingParams
from kernel_lab.ops.gguf_linear import kernel_available

pytestmark = [pytest.mark.usefixtures("one_cpu_thread", "bundled_model", "reference_only"),
              pytest.mark.skipif(not kernel_available(), reason="the quantized kernel needs a C compiler")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three colours of the rainbow are",
           "The chemical symbol for gold is", "In 1969, the first person to walk on the moon was",
           "import numpy as np\n", "My favourite food is", "Once upon a time"]
CHAT = [{"role": "user", "content": "Write a word."}]
KWARGS = dict(device="cpu", max_model_len=256, max_num_seqs=8, block_size=16)
LOGPROB_BOUND = 0.6


def _first_logprobs(engine: LLMEngine, prompts, params=None) -> list[dict[int, float]]:
    params = params or SamplingParams(max_tokens=1, temperature=0, logprobs=20)
    for i, p in enumerate(prompts):
        engine.add_request(f"lp{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}
    return [done[f"lp{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def quantized():
    return LLMEngine(None, weights="quantized", **KWARGS)


def test_auto_picks_quantized_and_memory_stays_near_the_file(quantized):
    from kernel_lab.models.gguf import default_model_path, tensor_bytes

    stats = quantized.stats()
    assert stats["weights"] == "quantized"
    assert LLMEngine(None, **KWARGS).stats()["weights"] == "quantized"  # the default where the kernel runs
    file_bytes = tensor_bytes(default_model_path())
    assert stats["resident_weight_bytes"] <= 1.2 * file_bytes
    fp32 = LLMEngine(None, weights="float32", **KWARGS).stats()
    assert stats["weight_bytes"] < fp32["weight_bytes"] / 5
    assert fp32["resident_weight_bytes"] > 4 * file_bytes  # the measure sees the difference


def test_logits_stay_near_the_fp32_path_on_the_same_weights(quantized):
    q_rows = _first_logprobs(quantized, PROMPTS)
    f_rows = _first_logprobs(LLMEngine(None, weights="float32", **KWARGS), PROMPTS)
    worst = 0.0
    for q, f in zip(q_rows, f_rows, strict=True):
        top = sorted(f, key=f.get, reverse=True)
        assert set(top[:5]) <= set(q), "fp32's five most likely tokens must be among the quantized top 20"
        worst = max(worst, *(abs(q[t] - f[t]) for t in top[:5]))
        if f[top[0]] - f[top[1]] > LOGPROB_BOUND:
            assert max(q, key=q.get) == top[0]
    assert worst <= LOGPROB_BOUND
    assert worst > 1e-3, "no difference at all: are the activations really quantized?"


def test_a_request_computes_the_same_bits_whatever_runs_beside_it(quantized):
    prompt = quantized.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    fresh = LLMEngine(None, weights="quantized", max_num_batched_tokens=24, **KWARGS)  # prompts split in chunks
    alone = _first_logprobs(fresh, [prompt])[0]
    batched = _first_logprobs(quantized, PROMPTS[:3] + [prompt] + PROMPTS[3:5])[3]
    cached = _first_logprobs(quantized, [prompt])[0]        # now its full blocks come from the prefix cache
    assert quantized.stats()["prefix_cache_hits"] > 0
    assert alone == batched == cached
    seeded = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.95, seed=1234, n=2)
    texts = []
    for engine, extra in ((fresh, []), (quantized, PROMPTS[:4])):
        for i, p in enumerate([prompt] + extra):
            engine.add_request(f"s{i}", p, seeded if i == 0 else SamplingParams(max_tokens=6, temperature=0.7))
        while engine.has_unfinished_requests():
            texts += [[c.token_ids for c in o.outputs] for o in engine.step() if o.finished and o.request_id == "s0"]
    assert texts[0] == texts[1]


def test_auto_leaves_a_cpu_without_vector_kernels_on_float32(monkeypatch):
    from kernel_lab.ops import gguf_linear

    monkeypatch.setattr(gguf_linear, "kernel_isa", lambda: "scalar")
    assert LLMEngine(None, **KWARGS).stats()["weights"] == "float32"
    assert LLMEngine(None, weights="quantized", **KWARGS).stats()["weights"] == "quantized"


def test_quantized_weights_are_refused_where_they_cannot_run():
    with pytest.raises(ValueError, match="weights.*float32 activations"):
        LLMEngine(None, weights="quantized", dtype="bfloat16", device="cpu", max_model_len=64)
    assert LLMEngine(None, dtype="bfloat16", device="cpu", max_model_len=64).stats()["weights"] == "float32"


def test_the_export_stays_a_plain_model_directory():
    """vLLM and transformers load every top-level *.safetensors of a model directory as weights: the blocks
    must live elsewhere (vLLM failed on a second top-level file)."""
    from kernel_lab.models.gguf import BLOCKS_FILE
    from kernel_lab.models.loader import has_quantized_weights, resolve_model_dir

    model_dir = resolve_model_dir(None)
    assert [p.name for p in model_dir.glob("*.safetensors")] == ["model.safetensors"]
    assert (model_dir / BLOCKS_FILE).is_file() and has_quantized_weights(model_dir)


def test_the_one_call_layer_attention_is_the_separate_ops(monkeypatch):
    """A CPU step's layers make one C call for RoPE, the KV write and attention (rope_write_paged_attention).
    With float32 weights (no int8 rounding to amplify an ulp) the first-token log-probabilities equal, to
    float32 noise, those of the same engine running apply_rope, write_kv and paged_decode_attention as
    separate ops."""
    from kernel_lab.engine.model_runner import ModelRunner
    from kernel_lab.ops import cpu_kernels

    calls = []
    fused_call = cpu_kernels.rope_write_paged_attention_cpu
    monkeypatch.setattr(cpu_kernels, "rope_write_paged_attention_cpu", lambda *a, **kw: calls.append(1) or fused_call(*a, **kw))
    engine = LLMEngine(None, weights="float32", **KWARGS)
    fused = _first_logprobs(engine, PROMPTS[:3])
    layers = engine.config.model_config.num_layers
    assert calls and len(calls) % layers == 0, "a CPU step did not take the one-call layer attention"

    check = ModelRunner._check_step_inputs

    def separate_ops(self, meta):
        check(self, meta)
        meta.fused_cpu_decode = False

    monkeypatch.setattr(ModelRunner, "_check_step_inputs", separate_ops)
    calls.clear()
    separate = _first_logprobs(LLMEngine(None, weights="float32", **KWARGS), PROMPTS[:3])
    assert not calls
    for a, b in zip(fused, separate, strict=True):
        top = sorted(b, key=b.get, reverse=True)[:5]
        assert sorted(a, key=a.get, reverse=True)[:5] == top
        assert max(abs(a[t] - b[t]) for t in top) < 1e-3


# ---------------------------------------------------------------------------------------- K-quant files
K_QUANT_MIX = {"token_embd": "Q4_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
               "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q6_K"}  # like Q4_K_M, plus Q5_K


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory, make_gguf):
    """A tiny Llama GGUF (make_1b_gguf.py's `tiny` shape, the bundled tokenizer) whose matrices are random
    K-quant blocks laid out as llama.cpp's Q4_K_M lays them out: v and down in Q6_K beside Q4_K, lm_head Q6_K."""
    return make_gguf.write_random(tmp_path_factory.mktemp("kquant") / "tiny-kquant.gguf", "tiny", K_QUANT_MIX)


def test_k_quant_files_run_on_their_blocks(k_quant_file):
    """Every projection, the embedding and the untied lm_head compute on the K-quant blocks (a q|k|v whose v is
    Q6_K beside Q4_K stacks both formats instead of falling back to float32), and the logits stay near the
    float32 path on the same weights."""
    from kernel_lab.models.llama import Linear, QuantizedLinear
    from kernel_lab.ops.gguf_linear import PackedStack

    engine = LLMEngine(str(k_quant_file), weights="quantized", **KWARGS)
    model = engine.runner.model
    assert not any(isinstance(m, Linear) for m in model.modules()), "a projection fell back to float32"
    layer = model.layers[0]
    assert isinstance(layer.qkv_proj.packed, PackedStack) and layer.qkv_proj.packed.format == "Q4_K+Q4_K+Q6_K"
    assert layer.o_proj.packed.format == "Q5_K" and layer.mlp.down_proj.packed.format == "Q6_K"
    assert model.embed.packed.format == "Q4_K" and isinstance(model.lm_head, QuantizedLinear)
    assert model.lm_head.packed.format == "Q6_K"
    q_rows = _first_logprobs(engine, PROMPTS[:4])
    f_rows = _first_logprobs(LLMEngine(str(k_quant_file), weights="float32", **KWARGS), PROMPTS[:4])
    worst = max(abs(q[t] - f[t]) for q, f in zip(q_rows, f_rows, strict=True) for t in f if t in q)
    assert 1e-4 < worst <= LOGPROB_BOUND


def test_gguf_files_load_in_place_without_a_float32_export(k_quant_file, make_gguf, caplog):
    """The engine's directory for a GGUF holds no weights (config, tokenizer, a marker naming the file): the
    blocks come from the file's memory map, so resident weights stay near the file's tensor bytes (the
    K-quant tiles widen Q4_K/Q5_K's 6-bit scales: +2.8%). A matrix in a format without a kernel (Q5_0 and
    F16 here) is dequantized alone, with a log line naming it."""
    import logging

    from kernel_lab.models.gguf import gguf_source, tensor_bytes
    from kernel_lab.models.loader import resolve_model_dir

    engine = LLMEngine(str(k_quant_file), weights="quantized", **KWARGS)
    assert gguf_source(engine.config.model_dir) == k_quant_file.resolve()
    assert not list(engine.config.model_dir.rglob("*.safetensors")), "the engine's GGUF directory must hold no weights"
    assert engine.stats()["resident_weight_bytes"] <= 1.1 * tensor_bytes(k_quant_file)
    assert list(resolve_model_dir(str(k_quant_file)).glob("*.safetensors")), "the full export stays available"

    mixed = k_quant_file.with_name("fallback.gguf")
    make_gguf.write_random(mixed, "tiny", {**K_QUANT_MIX, "attn_output": "Q5_0", "ffn_down": "F16"})
    with caplog.at_level(logging.INFO, logger="kernel_lab.models.gguf"):
        engine = LLMEngine(str(mixed), weights="quantized", **KWARGS)
    logged = sorted(r.getMessage() for r in caplog.records if "no quantized kernel" in r.getMessage())
    assert len(logged) == 4 and any("blk.0.attn_output.weight (Q5_0)" in m for m in logged)
    assert any("blk.1.ffn_down.weight (F16)" in m for m in logged)
    layer = engine.runner.model.layers[0]
    assert layer.qkv_proj.packed.format == "Q4_K+Q4_K+Q6_K" and layer.o_proj.weight.dtype == torch.float32


def test_truncated_or_corrupt_gguf_files_fail_at_load_with_the_offset(k_quant_file, tmp_path):
    from kernel_lab.models.gguf_file import GGUFFile

    data = k_quant_file.read_bytes()
    GGUFFile(k_quant_file)  # the intact file reads
    name = b"blk.0.attn_q.weight"
    type_at = data.index(name) + len(name) + 4 + 2 * 8  # after the rank and the two dimensions
    cases = {
        "truncated.gguf": (data[:-1000], r"tensor 'output.weight' at offset \d+ needs \d+ bytes but the file ends"),
        "header.gguf": (data[:5000], r"truncated or corrupt: .* at offset \d+ needs"),
        "magic.gguf": (b"GGML" + data[4:], "not a GGUF file"),
        "type.gguf": (data[:type_at] + (99).to_bytes(4, "little") + data[type_at + 4:],
                      "tensor 'blk.0.attn_q.weight' has an unknown ggml type 99"),
    }
    for file_name, (content, message) in cases.items():
        path = tmp_path / file_name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            LLMEngine(str(path), weights="quantized", **KWARGS)
