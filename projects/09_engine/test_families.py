"""Every registered model family (kernel_lab/models/registry.py) against transformers, in float32 on CPU.

Each family is a tiny random checkpoint built offline from transformers' config class (initializer_range 0.3,
so the top-2 margin of every greedy step is clear), saved with save_pretrained beside the bundled model's
tokenizer files. Our engine runs five prompts, two sharing a 40-token prefix, under continuous batching (more
prompts than max_num_seqs), chunked prefill (a 24-token budget) and a prefix-cache hit, on both CPU paths:
"fused" (every row through the C call rope_write_paged_attention, the engine's default) and "prefill"
(prompt chunks through the SDPA prefill path, decode rows through ops.paged_decode_attention). Greedy tokens
must equal transformers' and the first token's log-probability must match. Mistral's window (24) is shorter
than every prompt, so it binds on both paths.

Also here: each family's CUDA twin of that test (float16, GPU-marked; HALF_TOLERANCE says why float16), the
attention layer's sliding window on decode rows and prefill chunks against float64 (CPU, and GPU-marked CUDA
cases), `kernel-lab serve --model DIR` on each family's checkpoint, GGUF exports, Mixtral's MoE layer, and
the refusals of what is not implemented.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kernel_lab.engine import LLMEngine, SamplingParams
from kernel_lab.models.registry import ARCHITECTURES

NEW_TOKENS = 8
WINDOW = 24
SHARED = ("The following notes summarise a long technical report about the history of computing, from the "
          "first mechanical calculators through vacuum tubes and transistors. ")
PROMPTS = [SHARED + "Section one:",
           "Once upon a time, in a small village by the sea, there lived an old man who mended the nets of every "
           "fisherman in the harbour and asked",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
           SHARED + "Section two, on transistors:", "émoji 🤖 ünïcödé 中文 Ωμέγα   and then, after a run of spaces, "
           "a few more words"]
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, initializer_range=0.3, max_position_embeddings=512, rms_norm_eps=1e-6,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# family -> (transformers config class name, its settings beyond COMMON)
FAMILIES = {
    "llama3": ("LlamaConfig", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "mistral_window": ("MistralConfig", dict(sliding_window=WINDOW)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "gemma": ("GemmaConfig", dict(head_dim=256, num_attention_heads=2, num_key_value_heads=1,
                                  hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "phi3": ("Phi3Config", dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=2,
                                original_max_position_embeddings=512)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    # Qwen1.5-MoE's routing: the top-k weights not renormalised (norm_topk_prob false)
    "qwen_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                        shared_expert_intermediate_size=80, norm_topk_prob=False)),
}

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def tiny_checkpoint(family: str, directory, tokenizer_dir) -> None:
    """A random `family` checkpoint in `directory` with the bundled tokenizer's files."""
    transformers = pytest.importorskip("transformers")
    class_name, settings = {**FAMILIES, **GGUF_ONLY_FAMILIES}[family]
    config = getattr(transformers, class_name)(**{**COMMON, **settings})
    torch.manual_seed(sorted(FAMILIES).index(family) if family in FAMILIES else len(FAMILIES) + sorted(
        GGUF_ONLY_FAMILIES).index(family))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(directory))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, directory / name)


@pytest.fixture(scope="module")
def tokenizer_dir(bundled_model):
    from kernel_lab.models.loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir):
    made = {}

    def get(family):
        if family not in made:
            made[family] = tmp_path_factory.mktemp(family)
            tiny_checkpoint(family, made[family], tokenizer_dir)
        return made[family]

    return get


def transformers_greedy(directory, prompts: list[list[int]]):
    """(greedy continuations, log-probability of each first token, each step's top-2 logit margin), one
    prompt at a time (no padding), in float32 on CPU."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    tokens, first_logprobs, margins = [], [], []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(ids):].tolist())
            logprobs = torch.log_softmax(out.scores[0][0].float(), dim=-1)
            first_logprobs.append(float(logprobs[tokens[-1][0]]))
            margins.append([float(s[0].topk(2).values.diff().abs()) for s in out.scores])
    smallest = min(map(min, margins))
    assert smallest > 1e-3, f"a greedy step has top-2 margin {smallest}: the comparison is not decisive"
    return tokens, first_logprobs, margins


def engine_greedy(directory, path: str, **options):
    """(prompt ids, greedy tokens, first-token log-probabilities) of PROMPTS; `options` override the engine's
    settings (CPU, float32 activations and KV pages: the decoder against transformers at float32's tolerance;
    the default float16 pages are measured by kv_page_agreement.py and test_cpu_half_pages.py)."""
    settings = dict(dtype="float32", device="cpu", weights="float32", kv_cache_dtype="float32", max_model_len=256,
                    max_num_seqs=3, num_kv_blocks=48, max_num_batched_tokens=24, block_size=16)
    engine = LLMEngine(str(directory), **{**settings, **options})
    if path == "prefill":  # prompt chunks take the SDPA prefill path instead of the fused decode call
        engine.runner.prompt_tokens_decode = False
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    stats = engine.stats()
    assert stats["prefix_cache_hits"] > 0, "the shared prefix was meant to hit the prefix cache"
    assert stats["kv_cache_blocks_free"] == stats["kv_cache_blocks_total"], "blocks leaked"
    outs = [final[str(i)].outputs[0] for i in range(len(PROMPTS))]
    prompt_ids = [final[str(i)].prompt_token_ids for i in range(len(PROMPTS))]
    return prompt_ids, [o.token_ids for o in outs], [o.logprobs[0][o.token_ids[0]].logprob for o in outs]


@pytest.mark.parametrize("path", ["fused", "prefill"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(family, path, checkpoints, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # kernel_lab.ops' CPU paths (C kernels, torch reference)
    directory = checkpoints(family)
    prompt_ids, ours, our_logprobs = engine_greedy(directory, path)
    if family == "mistral_window":
        assert min(map(len, prompt_ids)) > WINDOW, "every prompt must be longer than the window"
    theirs, their_logprobs, _ = transformers_greedy(directory, prompt_ids)
    assert ours == theirs
    torch.testing.assert_close(torch.tensor(our_logprobs), torch.tensor(their_logprobs), rtol=1e-4, atol=1e-4)


# Half precision on CUDA. The CUDA decode kernel takes fp16/bf16 only (float32 is the CPU's). The engine runs in
# float16 on weights stored fp16-rounded (rounded_checkpoint), against transformers in float32 on those same
# weights, so what differs is the engine's rounding of activations (fp16: unit roundoff 2**-11) at every op.
# These random models (initializer_range 0.3) amplify it: measured with these checkpoints in float16 on CPU,
# every family's first-token log-probability stays within 0.04 of float32's and no greedy token flips, while
# dropping Mistral's window moves them by up to 0.55 and flips tokens at float32 margins of 0.17 and more.
# HALF_TOLERANCE bounds both: |log-probability difference|, and the float32 top-2 margin of the one step where a
# greedy stream may flip (a near-tie; the streams differ from there on). bf16 (2**-8) is not compared here: on
# CPU it flips tokens at margins above the median margin of these models (0.4), so no bound that passes it
# would fail a wrong window; the bf16 kernels are the same templates, and test_gpu.py runs a trained model in bf16.
HALF_TOLERANCE = 0.08


def rounded_checkpoint(checkpoint, directory, dtype: torch.dtype):
    """A copy of `checkpoint` in `directory` whose float32 weights are rounded to `dtype`: the engine's load
    in `dtype` is then exact and a float32 reference reads the very same weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, directory)
    weights = load_file(str(checkpoint / "model.safetensors"))
    save_file({name: w.to(dtype).float() for name, w in weights.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    return directory


@pytest.mark.gpu
@pytest.mark.cuda_extension
@pytest.mark.parametrize("graphs", [True, False], ids=["cuda_graphs", "eager"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers_on_cuda(family, graphs, checkpoints, tmp_path):
    """test_family_matches_transformers on CUDA in float16: the same prompts, continuous batching, chunked
    prefill and prefix-cache hit (engine_greedy), with decode-only steps replaying CUDA graphs or eager."""
    directory = rounded_checkpoint(checkpoints(family), tmp_path / family, torch.float16)
    prompt_ids, ours, our_logprobs = engine_greedy(directory, "prefill", device="cuda", dtype="float16",
                                                   kv_cache_dtype="auto", enforce_eager=not graphs)
    if family == "mistral_window":
        assert min(map(len, prompt_ids)) > WINDOW, "every prompt must be longer than the window"
    theirs, their_logprobs, margins = transformers_greedy(directory, prompt_ids)
    for i, (our_tokens, their_tokens) in enumerate(zip(ours, theirs, strict=True)):
        flip = next((t for t, (a, b) in enumerate(zip(our_tokens, their_tokens)) if a != b), None)
        assert flip is None or margins[i][flip] < HALF_TOLERANCE, \
            f"prompt {i}: token {flip} differs where float32's top-2 margin is {margins[i][flip]:.3f}: {our_tokens} " \
            f"vs {their_tokens}"
    torch.testing.assert_close(torch.tensor(our_logprobs), torch.tensor(their_logprobs), rtol=0, atol=HALF_TOLERANCE)


# ------------------------------------------------------------------------------------------------ serving
@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_serve_model_dir_serves_each_family(architecture, checkpoints, monkeypatch):
    """`kernel-lab serve --model DIR` on each registered family's tiny checkpoint: the app its flags build
    (launch.build_server, run_serve's), started in-process, completes a prompt with the greedy tokens, text and
    log-probabilities of an engine built from the same flags."""
    for module in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(module)
    import httpx

    from kernel_lab.cli import build_parser
    from kernel_lab.engine import LLM
    from kernel_lab.engine.arg_utils import engine_kwargs
    from kernel_lab.models.registry import model_class
    from kernel_lab.server.background import BackgroundServer
    from kernel_lab.server.launch import build_server

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    family = model_class(architecture).family_test.split("[", 1)[1].rstrip("]")
    argv = ["serve", "--model", str(checkpoints(family)), "--device", "cpu", "--dtype", "float32", "--weights",
            "float32", "--max-model-len", "128", "--max-num-seqs", "2", "--num-kv-blocks", "16"]
    args = build_parser(argv).parse_args(argv)
    engine = LLMEngine(**engine_kwargs(args))
    new_tokens, prompt = 4, PROMPTS[1]
    expected = LLM.from_engine(engine).generate(prompt, SamplingParams(temperature=0, max_tokens=new_tokens,
                                                                       ignore_eos=True, logprobs=1))[0].outputs[0]
    app, async_engine = build_server(args)
    with BackgroundServer(app) as server:
        assert async_engine.ready_event.wait(60) and async_engine.state == "ready", async_engine.error
        response = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 1})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    token_texts = [engine.tokenizer.decode([t], skip_special_tokens=False) for t in expected.token_ids]
    assert choice["logprobs"]["tokens"] == token_texts and choice["text"] == expected.text
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        [entry[t].logprob for entry, t in zip(expected.logprobs, expected.token_ids, strict=True)], abs=1e-5)


# ------------------------------------------------------------------------------------------------ windowed attention
def windowed_attention64(q, k, v, positions, window: int | None, scale: float) -> torch.Tensor:
    """float64 attention of queries at `positions` [n] over keys 0.. of one sequence, with transformers'
    sliding-window mask (key kv visible to query q iff q - window < kv <= q)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    key_pos = torch.arange(k.shape[0])[None, :]
    visible = (key_pos <= positions[:, None]) & (key_pos > positions[:, None] - (window or 1 << 30))
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


CUDA_MARKS = [pytest.mark.gpu, pytest.mark.cuda_extension]


@pytest.mark.parametrize("device, dtype", [
    pytest.param("cpu", torch.float32, id="cpu-float32"), pytest.param("cpu", torch.bfloat16, id="cpu-bfloat16"),
    pytest.param("cuda", torch.float16, marks=CUDA_MARKS, id="cuda-float16"),
    pytest.param("cuda", torch.bfloat16, marks=CUDA_MARKS, id="cuda-bfloat16"),
])
@pytest.mark.parametrize("head_dim", [96, 64])
@pytest.mark.parametrize("window", [7, None], ids=["window7", "no_window"])
def test_paged_attention_windows_decode_rows_and_prefill_chunks(device, dtype, head_dim, window, monkeypatch):
    """models/attention.paged_attention over one flat batch: a decode row, a prefill chunk after a cached
    prefix longer than the window, one after a prefix shorter than it, and a chunk with no prefix, against a
    float64 reference with transformers' window mask. Cache slots no query may see hold NaN, so reading one
    fails; Phi-3's head_dim 96 and a common 64."""
    from kernel_lab import ops
    from kernel_lab.harness.testing import assert_close, case_seed, randn
    from kernel_lab.models.attention import AttentionMetadata, LayerKVCache, PrefillChunk, paged_attention

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    block_size, num_blocks, num_q_heads, num_kv_heads, scale = 8, 16, 4, 2, head_dim ** -0.5
    seed = case_seed("windowed-paged-attention", device, str(dtype), head_dim, window)
    # (cached tokens, new tokens): the decode row first, as the model runner orders a step
    sequences = [(29, 1), (19, 5), (3, 4), (0, 11)]
    pages = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = k_cache.clone()
    cache = LayerKVCache(k_cache, v_cache)
    rows_q, rows_k, rows_v, slots, tables, expected, prefills = [], [], [], [], [], [], []
    for i, (cached, new) in enumerate(sequences):
        length = cached + new
        table = [pages.pop() for _ in range(-(-length // block_size))]
        seq_slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)])
        k = randn((length, num_kv_heads, head_dim), dtype, device, seed + 10 * i + 1)
        v = randn((length, num_kv_heads, head_dim), dtype, device, seed + 10 * i + 2)
        q = randn((new, num_q_heads, head_dim), dtype, device, seed + 10 * i + 3)
        oldest_seen = max(0, cached - window + 1) if window else 0
        seen = torch.arange(oldest_seen, cached)  # the cached positions some query of this sequence sees
        ops.write_kv(k[seen], v[seen], k_cache, v_cache, seq_slots[seen].to(device))
        positions = torch.arange(cached, length)
        expected.append(windowed_attention64(q.cpu(), k.cpu(), v.cpu(), positions, window, scale))
        start = sum(len(r) for r in rows_q)
        rows_q.append(q), rows_k.append(k[cached:]), rows_v.append(v[cached:])
        slots.append(seq_slots[cached:])
        if new == 1:
            tables.append(table)
        else:
            prefills.append(PrefillChunk(start, start + new, cached, seq_slots[:cached].to(device)))
    meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(device), num_decode_tokens=1,
                             decode_block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
                             decode_seq_lens=torch.tensor([sum(sequences[0])], dtype=torch.int32, device=device),
                             prefills=prefills)
    out = paged_attention(torch.cat(rows_q), torch.cat(rows_k), torch.cat(rows_v), cache, meta, scale, window)
    assert_close(out, torch.cat(expected), dtype, scale=2.0)


# ------------------------------------------------------------------------------------------------ GGUF
def test_llama3_gguf_with_rope_freqs_loads_as_transformers_reads_its_export(tmp_path, make_gguf, tokenizer_dir,
                                                                           monkeypatch):
    """A Llama 3.1-style GGUF (a `rope_freqs` tensor, as llama.cpp's converter writes it) loads with the llama3
    rope_parameters those divisors encode; our engine's first-token log-probs on a prompt past the original
    context (64) match transformers on the exported directory."""
    from kernel_lab.engine import LLM
    from kernel_lab.models.config import ModelConfig
    from kernel_lab.models.gguf import export_hf_directory, load_gguf
    from kernel_lab.models.layers.rotary import rope_inv_freq
    from kernel_lab.models.rope_scaling import default_inv_freq, inv_freq_from_rope_freqs, llama3_inv_freq

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    head_dim, context = 64, 64
    # llama.cpp's divisors: default over scaled frequencies (test_rope_scaling.py checks its converter's formula)
    rope_freqs = default_inv_freq(head_dim, 10000.0) / llama3_inv_freq(head_dim, 10000.0, 8.0, 1.0, 4.0, context)
    path = make_gguf.write_random(tmp_path / "llama3.gguf", "tiny", {}, seed=5, rope_freqs=rope_freqs.numpy())
    config, state_dict, _ = load_gguf(path)
    assert "rope_freqs.weight" not in state_dict
    assert config["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": context}
    torch.testing.assert_close(rope_inv_freq(ModelConfig.from_hf(config)),
                               inv_freq_from_rope_freqs(head_dim, 10000.0, rope_freqs), rtol=2e-6, atol=0)
    engine = LLMEngine(str(path), dtype="float32", device="cpu", weights="float32", max_model_len=256,
                       max_num_seqs=2, num_kv_blocks=32, block_size=16)
    prompt = " ".join(["a long prompt that runs past the original context of sixty-four tokens"] * 8)
    result = LLM.from_engine(engine).generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    ids = result.prompt_token_ids
    assert len(ids) > context
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export_hf_directory(path)), dtype=torch.float32)
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
    for token, entry in result.outputs[0].logprobs[0].items():
        assert entry.logprob == pytest.approx(float(logprobs[token]), abs=1e-4)


@pytest.mark.parametrize("fmt", ["F32", "Q8_0"])
def test_gguf_expert_tensors_read_as_each_experts_matrix(fmt, tmp_path):
    """A `llama` GGUF with experts (as llama.cpp writes Mixtral): each stacked [experts, rows, columns] tensor
    reads back as every expert's matrix under Mixtral's names, in a block format too, and its experts stay out
    of the quantized path (ops.moe takes float experts)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    from gguf.quants import dequantize, quantize

    from kernel_lab.harness.testing import case_seed
    from kernel_lab.models.gguf import gguf_weights, load_gguf

    experts, hidden, inter = 3, 64, 96
    qtype = gguf.GGMLQuantizationType[fmt]
    generator = np.random.default_rng(case_seed("gguf-experts", fmt))
    writer = gguf.GGUFWriter(str(tmp_path / "moe.gguf"), "llama")
    for key, value in [("block_count", 1), ("embedding_length", hidden), ("feed_forward_length", inter),
                       ("attention.head_count", 4), ("expert_count", experts), ("expert_used_count", 2)]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_uint32("llama.vocab_size", 32)
    stacked = {}
    for name, shape in [("ffn_gate_exps", (experts, inter, hidden)), ("ffn_up_exps", (experts, inter, hidden)),
                        ("ffn_down_exps", (experts, hidden, inter))]:
        values = generator.standard_normal(shape, dtype=np.float32)
        data = values if fmt == "F32" else quantize(values, qtype)
        writer.add_tensor(f"blk.0.{name}.weight", data, raw_dtype=None if fmt == "F32" else qtype)
        stacked[name] = values if fmt == "F32" else dequantize(data, qtype).reshape(shape)
    writer.add_tensor("blk.0.ffn_gate_inp.weight", generator.standard_normal((experts, hidden), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config, state_dict, _ = load_gguf(tmp_path / "moe.gguf")
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (experts, 2)
    assert len(state_dict) == 3 * experts + 1
    prefix = "model.layers.0.block_sparse_moe."
    for name, w in [("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"), ("ffn_down_exps", "w2")]:
        for j in range(experts):
            assert torch.equal(state_dict[f"{prefix}experts.{j}.{w}.weight"], torch.from_numpy(stacked[name][j]))
    assert gguf_weights(tmp_path / "moe.gguf", quantized=True) == {}


# ------------------------------------------------------------------------------------------------ MoE layer
@pytest.mark.parametrize("architecture", ["MixtralForCausalLM", "Qwen2MoeForCausalLM"])
@pytest.mark.parametrize("interpret", ["0", "1"])
def test_mixture_of_experts_layer_matches_float64(interpret, architecture, monkeypatch):
    """The MoE layer (llama.MixtureOfExperts) through ops.moe: the torch path (TRITON_INTERPRET=0: one gather
    and two matmuls per expert) and project 07's Triton kernels (the interpreter), against a float64 per-token
    reference of softmax, top-2, SwiGLU experts and the weighted sum: Mixtral's renormalised top-2, and
    Qwen1.5-MoE's top-2 left as probabilities plus the shared expert scaled by sigmoid(shared_expert_gate(x))."""
    from kernel_lab import ops
    from kernel_lab.harness.testing import case_seed, randn
    from kernel_lab.models.config import EXPERT_NAMES
    from kernel_lab.models.llama import MixtureOfExperts

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    experts, hidden, inter, shared_inter, tokens = 5, 48, 40, 24, 11
    qwen = architecture == "Qwen2MoeForCausalLM"
    seed = case_seed("moe-layer", interpret, architecture)
    config = type("Config", (), {"architecture": architecture, "num_experts": experts, "experts_per_token": 2,
                                 "renormalize_experts": not qwen, "shared_expert_intermediate_size": shared_inter * qwen,
                                 "fused_projections": False, "hidden_act": "silu"})()
    prefix, *routed = EXPERT_NAMES[architecture]
    weights = {f"{prefix}gate.weight": randn((experts, hidden), torch.float32, "cpu", seed)}
    # each expert's (gate, up, down) names and width: the routed ones, then Qwen's shared expert
    mlps = [([f"{prefix}experts.{j}.{part}.weight" for part in routed], inter) for j in range(experts)]
    if qwen:
        mlps.append(([f"{prefix}shared_expert.{part}_proj.weight" for part in ("gate", "up", "down")], shared_inter))
        weights[f"{prefix}shared_expert_gate.weight"] = randn((1, hidden), torch.float32, "cpu", seed + 98)
    for j, ((g, u, d), width) in enumerate(mlps):
        for k, (name, shape) in enumerate([(g, (width, hidden)), (u, (width, hidden)), (d, (hidden, width))]):
            weights[name] = randn(shape, torch.float32, "cpu", seed + 10 * j + k + 1) * 0.3
    x = randn((tokens, hidden), torch.float32, "cpu", seed + 99)
    calls = []
    real_moe = ops.moe
    monkeypatch.setattr(ops, "moe", lambda *a, **k: calls.append(1) or real_moe(*a, **k))
    out = MixtureOfExperts(config, weights)(x)
    assert calls, "the layer must run through ops.moe"
    w = {n: t.double() for n, t in weights.items()}

    def swiglu(mlp, xt):
        g, u, d = (w[name] for name in mlp[0])
        return d @ (torch.nn.functional.silu(g @ xt) * (u @ xt))

    expected = torch.empty(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        xt = x[t].double()
        top = torch.topk(torch.softmax(w[f"{prefix}gate.weight"] @ xt, dim=-1), 2)
        scale = top.values if qwen else top.values / top.values.sum()
        expected[t] = sum(p * swiglu(mlps[e], xt) for p, e in zip(scale, top.indices.tolist(), strict=True))
        if qwen:
            expected[t] += torch.sigmoid(w[f"{prefix}shared_expert_gate.weight"] @ xt) * swiglu(mlps[-1], xt)
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------------------------------------ refusals
BASE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("config, message", [
    ({"architectures": ["Gemma2ForCausalLM"]}, "'Gemma2ForCausalLM': Gemma 2's attention and final logit softcapping"),
    ({"architectures": ["Qwen3MoeForCausalLM"]}, "'Qwen3MoeForCausalLM': Qwen3-MoE is not implemented"),
    ({"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "mlp_only_layers": [0]},
     "Qwen-MoE's dense layers between sparse ones are not implemented"),
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported model architecture .*supported: LlamaForCausalLM"),
    ({"architectures": ["LlamaForCausalLM"], "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     "unsupported rope type 'yarn'"),
    ({"architectures": ["Phi3ForCausalLM"], "rope_parameters": {"rope_type": "longrope"}},
     "unsupported rope type 'longrope'"),
    ({"architectures": ["LlamaForCausalLM"], "final_logit_softcapping": 30.0},
     "unsupported final_logit_softcapping=30.0: logit softcapping is not implemented"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 16},
     "use_sliding_window=true: Qwen's per-layer sliding windows"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_act": "relu"}, "unsupported hidden_act 'relu'"),
    ({"architectures": ["GemmaForCausalLM"], "hidden_act": "relu"}, "unsupported hidden_act 'relu' for Gemma"),
    ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.5}, "unsupported partial_rotary_factor"),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 2, "num_experts_per_tok": 3},
     r"num_experts_per_tok 3 must be in \[1, num_local_experts=2\]"),
])
def test_unsupported_architectures_and_features_are_refused_by_name(config, message):
    from kernel_lab.models.config import ModelConfig

    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**BASE, **config})


def test_readme_family_table_is_the_registry_and_each_row_has_a_test():
    from pathlib import Path

    from kernel_lab.models.registry import ARCHITECTURES, family_table, model_class

    readme = (Path(__file__).parent / "README.md").read_text()
    table = readme.split("<!-- family-table:start -->\n", 1)[1].split("\n<!-- family-table:end -->", 1)[0]
    assert table == family_table(), "regenerate the README's family table from kernel_lab.models.registry"
    ids = {f"test_families.py::test_family_matches_transformers[{family}]" for family in FAMILIES}
    for arch in ARCHITECTURES:
        assert model_class(arch).family_test in ids, f"{arch}'s row names no test of this file"
        assert model_class(arch).family_test != model_class("LlamaForCausalLM").family_test or \
            arch == "LlamaForCausalLM", f"{arch} must have its own test"


# Checkpoints only the GGUF tests use: a plain Llama (the llama3 family's head_dim 16 leaves one frequency
# between llama3's cut-offs, too few to recover its rope_parameters from the converter's rope_freqs;
# test_llama3_gguf_with_rope_freqs_loads_as_transformers_reads_its_export covers that tensor at head_dim 64).
GGUF_ONLY_FAMILIES = {"llama": ("LlamaConfig", {})}
LLAMA_CPP_CONVERTER = Path(__file__).resolve().parents[2] / ".llama-cpp-converter" / "convert_hf_to_gguf.py"
# What llama.cpp's converter cannot do with a tiny checkpoint that borrows SmolLM2's tokenizer files
CONVERTER_CANNOT = {
    "qwen2": "transformers 5 tokenizes every qwen2 checkpoint with Qwen2Tokenizer whatever tokenizer_config.json "
             "names (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), and its pre-tokenizer on SmolLM2's vocabulary "
             "hashes to none the converter knows (\"BPE pre-tokenizer was not recognized\")",
    "gemma": "the converter reads a Gemma vocabulary only from a SentencePiece tokenizer.model; the checkpoint "
             "has SmolLM2's BPE tokenizer.json",
}


@pytest.fixture(scope="module")
def llama_cpp_convert(tmp_path_factory):
    """convert(family, checkpoint, path): the checkpoint as a float32 GGUF written by llama.cpp's own
    converter (`make llama-cpp-converter`; LLAMA_CPP_CONVERTER overrides its path), in one converter process
    for the module (convert_with_llama_cpp.py); skips where it is absent or, for CONVERTER_CANNOT, fails."""
    import contextlib
    import json
    import os
    import subprocess
    import sys

    converter = Path(os.environ.get("LLAMA_CPP_CONVERTER", LLAMA_CPP_CONVERTER))
    log = tmp_path_factory.mktemp("llama-cpp-converter") / "log.txt"
    stack, worker = contextlib.ExitStack(), None  # started now: its imports overlap the first checkpoint's build
    if converter.is_file():
        worker = subprocess.Popen([sys.executable, str(Path(__file__).parent / "convert_with_llama_cpp.py"),
                                   str(converter)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=stack.enter_context(log.open("w")), text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})

    def convert(family, checkpoint, path):
        if worker is None:
            pytest.skip(f"llama.cpp's converter is not at {converter} (make llama-cpp-converter)")
        # its name becomes general.name, and llama.cpp looks up Phi-3's special tokens ("</s>", "<unk>") in the
        # vocabulary of a model named "phi3": SmolLM2's has none, so the name says nothing of the family
        source = path.parent / "checkpoint"
        source.mkdir()
        for item in checkpoint.iterdir():
            (source / item.name).symlink_to(item)
        if family == "phi3":  # its converter reads tokenizer.json's BPE vocabulary for a GPT2Tokenizer (Phi-4's)
            settings = json.loads((checkpoint / "tokenizer_config.json").read_text())
            (source / "tokenizer_config.json").unlink()
            (source / "tokenizer_config.json").write_text(json.dumps({**settings, "tokenizer_class": "GPT2Tokenizer"}))
        worker.stdin.write(json.dumps([str(source), str(path)]) + "\n")
        worker.stdin.flush()
        reply = worker.stdout.readline()
        assert reply, f"llama.cpp's converter process exited:\n{log.read_text()[-3000:]}"
        error = json.loads(reply)
        if error and family in CONVERTER_CANNOT:
            pytest.skip(f"llama.cpp's converter cannot convert the tiny {family} checkpoint: "
                        f"{CONVERTER_CANNOT[family]} (it said: {error})")
        assert error is None, f"llama.cpp's converter failed on {family}: {error}\n{log.read_text()[-3000:]}"

    with stack:
        yield convert
        if worker is not None:
            worker.stdin.close()
            worker.wait(timeout=60)


def write_gguf(checkpoint, path, architecture: str) -> None:
    """The checkpoint as a float32 GGUF in llama.cpp's layout for `architecture` (tensor names of
    models/gguf.py, rows unpermuted: qwen2, qwen3 and gemma use NEOX RoPE; gemma's norms stored as 1 + w, as
    llama.cpp's converter writes them), with the bundled GGUF's tokenizer: the GGUFs of the families the
    converter cannot convert here, and a qwen3 one where the converter is not installed."""
    import json

    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    from kernel_lab.models import gguf as ours
    from kernel_lab.models.gguf_file import GGUFFile

    config = json.loads((checkpoint / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(0)  # all F32
    source = GGUFFile(ours.default_model_path())
    for name, value in source.metadata.items():
        if name.startswith("tokenizer."):
            value_type, item_type = source.value_types[name]
            writer.add_key_value(name, value, gguf.GGUFValueType(value_type),
                                 sub_type=None if item_type is None else gguf.GGUFValueType(item_type))
    layer_names = {hf: g for g, hf in ours._LAYER_TENSORS.items()}
    global_names = {hf: g for g, hf in ours._GLOBAL_TENSORS.items()}
    for name, tensor in load_file(str(checkpoint / "model.safetensors")).items():
        stem, _, suffix = name.rpartition(".")
        if stem in global_names:
            gguf_name = global_names[stem]
        else:
            _, _, layer, part = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{layer_names[part]}"
        if architecture == "gemma" and stem.endswith("norm"):
            tensor = tensor.float() + 1.0
        writer.add_tensor(f"{gguf_name}.{suffix}", tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("family, writer", [
    *[(family, "converter") for family in ["llama", "mistral_window", "qwen2", "qwen3", "gemma", "phi3", "mixtral",
                                           "qwen_moe"]],
    ("qwen2", "ours"), ("qwen3", "ours"), ("gemma", "ours")])
def test_gguf_matches_transformers_and_llama_cpp(family, writer, tmp_path, checkpoints, llama_cpp_convert,
                                                monkeypatch):
    """Each family's GGUF, written by llama.cpp's converter where it converts the tiny checkpoint (else by
    write_gguf): our engine on it matches transformers on the checkpoint; where .venv-llamacpp exists,
    llama.cpp's greedy tokens on the same file do too, which checks the layout the file is written in.
    Mistral converts as `llama` without its window, and llama.cpp runs that architecture with full attention:
    so do we, and transformers is the checkpoint with `sliding_window` null."""
    import json

    from kernel_lab.bench.throughput import DEFAULT_LLAMA_CPP_PYTHON, run_llama_cpp
    from kernel_lab.models.config import ModelConfig
    from kernel_lab.models.gguf import load_gguf

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    checkpoint = checkpoints(family)
    path = tmp_path / f"{family}.gguf"
    if writer == "converter":
        llama_cpp_convert(family, checkpoint, path)
    else:
        write_gguf(checkpoint, path, family)
    config = ModelConfig.from_hf(load_gguf(path)[0])
    architecture = json.loads((checkpoint / "config.json").read_text())["architectures"][0]
    assert config.architecture == {"MistralForCausalLM": "LlamaForCausalLM"}.get(architecture, architecture)
    if family == "mistral_window":
        assert config.sliding_window is None, "llama.cpp runs a Mistral GGUF with full attention"
        reference = tmp_path / "mistral-full-attention"
        shutil.copytree(checkpoint, reference)
        settings = json.loads((reference / "config.json").read_text())
        (reference / "config.json").write_text(json.dumps({**settings, "sliding_window": None}))
    else:
        reference = checkpoint
    prompt_ids, ours, our_logprobs = engine_greedy(path, "fused")
    theirs, their_logprobs, _ = transformers_greedy(reference, prompt_ids)
    assert ours == theirs
    torch.testing.assert_close(torch.tensor(our_logprobs), torch.tensor(their_logprobs), rtol=1e-4, atol=1e-4)
    if not DEFAULT_LLAMA_CPP_PYTHON.exists():
        pytest.skip("llama.cpp's side needs .venv-llamacpp (make llama-cpp-env)")
    # an f32 KV cache without flash attention: llama.cpp's defaults (f16 K and V) flip greedy steps whose top-2
    # margin is near 0.01 (seen on Mixtral's)
    result = run_llama_cpp(DEFAULT_LLAMA_CPP_PYTHON, {"model": str(path), "prompts": prompt_ids[:2],
                                                      "output_len": NEW_TOKENS, "concurrency": 1, "threads": 1,
                                                      "warmup": False, "kv_cache_type": "f32"})
    assert result["outputs"] == theirs[:2]
