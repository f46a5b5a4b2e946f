"""The engine on the real bundled model (SmolLM2-135M-Instruct), fp32 on CPU through kernel_lab.ops'
PyTorch reference path.

- Greedy parity with Hugging Face transformers: 18 prompts of different lengths, 64 new tokens each,
  run together under continuous batching (more prompts than max_num_seqs, and some added while others
  run), with chunked prefill (a small token budget), prompts sharing a long prefix (the prefix cache
  must hit) and a KV pool small enough to force preemption (64 blocks of 16 for up to 16 sequences). Every token must equal transformers' greedy
  output. Decode-only steps take the padded static path that CUDA graphs replay.
- Tokenisation and chat template parity with transformers' tokenizer for the exported directory.
- Sampling semantics (stop strings, stop token ids, EOS, max_tokens, n, logprobs, seeds, streaming),
  abort, max_model_len, and the fp8 KV cache refused on CPU (no kernel reads it there).
"""

from __future__ import annotations

import math

import pytest
import torch

from kernel_lab.engine import LLM, LLMEngine, SamplingParams
from kernel_lab.models.loader import resolve_model_dir

NEW_TOKENS = 64
SHARED_PREFIX = (
    "The following notes summarise a long technical report about the history of computing, from the "
    "first mechanical calculators through vacuum tubes, transistors and integrated circuits to the "
    "accelerators used for machine learning today. Each section ends with a short list of key dates. "
)
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Water boils at",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "In 1969, the first humans landed on",
    "import numpy as np\n\ndef softmax(x):",
    "A haiku about the sea:\n",
    "Dear hiring manager,\n\nI am writing to apply for",
    SHARED_PREFIX + "Section 1: mechanical calculators.",
    SHARED_PREFIX + "Section 2: vacuum tubes.",
    "The three primary colors are",
    "Photosynthesis is the process by which",
    SHARED_PREFIX + "Section 3: transistors.",
    SHARED_PREFIX + "Section 4: integrated circuits and the microprocessor.",
    "Q: What is 12 times 7?\nA:",
    "The best way to learn a new language is",
]
SHARED = {i for i, p in enumerate(PROMPTS) if p.startswith(SHARED_PREFIX)}
FIRST_WAVE = 10   # added before the first step; the rest join while these run
CHAT = [[{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Name a primary color."}]]

ENGINE_KWARGS = dict(dtype="float32", device="cpu", weights="float32", max_model_len=512, max_num_seqs=16, num_kv_blocks=64,
                     max_num_batched_tokens=128, block_size=16)


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _in_reference_mode(fn):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        return fn()


@pytest.fixture(scope="module")
def model_dir(bundled_model):
    return resolve_model_dir(None)  # exported once into the user cache; free afterwards


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine(None, pad_decode_batches=True, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def hf_greedy(model_dir, engine):
    """transformers' greedy continuations (EOS off) of PROMPTS and of the chat prompts, in one left-padded
    batch; the model is loaded from the exported directory in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS] + \
        [engine.tokenizer.apply_chat_template(c) for c in CHAT]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0)
    return [row[width:].tolist() for row in out]


@pytest.fixture(scope="module")
def engine_run(engine):
    """Our engine on the same prompts: continuous batching, chunked prefill, prefix caching, preemption."""
    def run():
        greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        for i in range(FIRST_WAVE):
            engine.add_request(f"p{i}", PROMPTS[i], greedy)
        final, steps = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            steps += 1
            if steps == 3:
                for i in range(FIRST_WAVE, len(PROMPTS)):
                    engine.add_request(f"p{i}", PROMPTS[i], greedy)
                for j, chat in enumerate(CHAT):  # these stop at EOS
                    engine.add_request(f"c{j}", engine.tokenizer.apply_chat_template(chat),
                                       SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
        return final, engine.stats()

    return _in_reference_mode(run)


def test_greedy_parity_with_transformers(reference_only, engine_run, hf_greedy, engine):
    final, stats = engine_run
    assert stats["num_preemptions"] > 0, "the KV pool was meant to force preemption"
    assert stats["prefix_cache_hits"] > 0
    # A shared-prefix prompt admitted after the first one finished its prefill reused its full blocks.
    shared_prefix_blocks = len(engine.tokenizer.encode(SHARED_PREFIX)) // 16
    assert max(final[f"p{i}"].num_cached_tokens for i in SHARED) >= 16 * (shared_prefix_blocks - 1)
    assert stats["kv_cache_blocks_free"] == stats["kv_cache_blocks_total"], "blocks leaked"
    mismatches = []
    for i in range(len(PROMPTS)):
        ours, theirs = final[f"p{i}"].outputs[0].token_ids, hf_greedy[i]
        assert len(ours) == NEW_TOKENS and final[f"p{i}"].outputs[0].finish_reason == "length"
        if ours != theirs:
            at = next(k for k in range(NEW_TOKENS) if ours[k] != theirs[k])
            mismatches.append(f"prompt {i}: first difference at token {at}: {ours[at]} vs {theirs[at]}")
    eos = engine.tokenizer.eos_token_ids
    for j in range(len(CHAT)):
        out = final[f"c{j}"].outputs[0]
        theirs = hf_greedy[len(PROMPTS) + j]
        stop = next(k for k, t in enumerate(theirs) if t in eos)  # transformers would stop there
        assert out.token_ids == theirs[:stop + 1], f"chat {j}: {out.token_ids} vs {theirs[:stop + 1]}"
        assert out.finish_reason == "stop" and out.stop_reason is None
        assert "<|im_end|>" not in out.text and out.text == engine.tokenizer.decode(out.token_ids)
    assert not mismatches, "\n".join(mismatches)


def test_outputs_decode_to_their_text(reference_only, engine_run, engine):
    final, _ = engine_run
    for i in range(len(PROMPTS)):
        out = final[f"p{i}"].outputs[0]
        assert out.text == engine.tokenizer.decode(out.token_ids)


def test_one_token_budget_steps_match(reference_only, engine_run):
    """A token budget of 2 with 2 sequences: every step is one decode token plus a one-token prompt chunk,
    so the padded static decode path (the CUDA-graph layout) carries rows that must not sample."""
    final, _ = engine_run
    tiny = LLMEngine(None, **{**ENGINE_KWARGS, "max_num_seqs": 2, "max_num_batched_tokens": 2,
                               "num_kv_blocks": 40}, pad_decode_batches=True)
    prepare, seen = tiny.runner._prepare, []

    def recording_prepare(items):
        prepared = prepare(items)
        decodes, chunk_specs, sample_rows = prepared.decodes, prepared.chunk_specs, prepared.sample_rows
        seen.append(not chunk_specs and len(sample_rows) < len(decodes))
        return prepared

    tiny.runner._prepare = recording_prepare
    outs = LLM.from_engine(tiny).generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert any(seen), "no static step carried a non-sampling row"
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == final[f"p{i}"].outputs[0].token_ids[:8]


# ------------------------------------------------------------------------------------------------ tokenizer
TEXTS = [
    "Hello world", "The capital of France is", "12345 apples cost $3.50, or 1,000,000 yen",
    "  leading spaces\n\n\nnew lines\ttabs  ", "<|im_start|>user\nhi<|im_end|>\n", "émoji 🤖 ünïcödé 中文 Ωμέγα",
    "don't I'll we've THEY'RE", "x" * 300, "def f(a, b):\n    return a ** 2 + b", "<|endoftext|><reponame>",
    "a\u00a0b\u2003c", "",
]


def test_tokenization_matches_transformers(engine, hf_tokenizer):
    tok = engine.tokenizer
    for text in TEXTS:
        ours = tok.encode(text)
        assert ours == hf_tokenizer.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == hf_tokenizer.encode(text, add_special_tokens=False)
        assert tok.decode(ours) == hf_tokenizer.decode(ours, skip_special_tokens=True)
        assert tok.decode(ours, skip_special_tokens=False) == hf_tokenizer.decode(ours)
    # The bundled model's pre-tokenizer ("smollm" in the GGUF) splits digits one by one.
    assert len(tok.encode("12345")) == 5
    assert tok.eos_token_ids == {2} and tok.bos_token_id == 1


def test_chat_template_matches_transformers(engine, hf_tokenizer):
    tok = engine.tokenizer
    conversations = CHAT + [
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "And 3+3?"}],
    ]
    for conv in conversations:
        for add in (True, False):
            theirs = hf_tokenizer.apply_chat_template(conv, add_generation_prompt=add, tokenize=True)
            theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
            assert tok.apply_chat_template(conv, add_generation_prompt=add) == list(theirs)
            assert tok.apply_chat_template(conv, add_generation_prompt=add, tokenize=False) == \
                hf_tokenizer.apply_chat_template(conv, add_generation_prompt=add, tokenize=False)


# ------------------------------------------------------------------------------------------------ semantics
def _generate(engine, prompts, params):
    return LLM.from_engine(engine).generate(prompts, params)


def test_stop_strings_stop_token_ids_and_max_tokens(reference_only, engine):
    prompt = "The capital of France is"
    base = _generate(engine, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 24
    # Stop string: the text ends right before it; it stays out of the text.
    needle = base.text[10:14]
    cut = base.text.index(needle)
    out = _generate(engine, prompt, SamplingParams(temperature=0, max_tokens=24, stop=[needle, "zzzz"]))[0]
    c = out.outputs[0]
    assert c.text == base.text[:cut] and c.finish_reason == "stop" and c.stop_reason == needle
    kept = _generate(engine, prompt, SamplingParams(temperature=0, max_tokens=24, stop=needle,
                                                    include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == base.text[:cut + len(needle)]
    # Stop token id: generation ends at its first occurrence, which stays in token_ids.
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    c = _generate(engine, prompt, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]))[0]
    c = c.outputs[0]
    assert c.token_ids == base.token_ids[:first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_id
    c = _generate(engine, prompt, SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert c.token_ids == base.token_ids[:3] and c.finish_reason == "length"


def test_n_logprobs_and_streaming(reference_only, engine):
    prompt = "Once upon a time"
    out = _generate(engine, prompt, SamplingParams(n=2, temperature=0, max_tokens=8, logprobs=3))[0]
    a, b = out.outputs
    assert (a.index, b.index) == (0, 1) and a.token_ids == b.token_ids
    assert len(a.logprobs) == 8
    for token, entry in zip(a.token_ids, a.logprobs, strict=True):
        assert token in entry and entry[token].rank == 1  # greedy picks the most likely token
        top = sorted(entry.values(), key=lambda lp: lp.rank)[:3]
        assert [lp.rank for lp in top] == [1, 2, 3] and top[0].logprob >= top[1].logprob >= top[2].logprob
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert math.isclose(a.cumulative_logprob, sum(e[t].logprob for t, e in zip(a.token_ids, a.logprobs)),
                        rel_tol=1e-6)
    llm = LLM.from_engine(engine)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    pieces = list(llm.stream(prompt, params))
    assert len(pieces) > 1
    assert "".join(pieces) == llm.generate(prompt, params)[0].outputs[0].text


def test_seeded_sampling_is_reproducible_and_batch_independent(reference_only, engine):
    prompt = "Write a list of fruits:"
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = _generate(engine, prompt, params)[0].outputs[0].token_ids
    again = _generate(engine, [prompt, "Unrelated prompt", "Another"],
                      [params, SamplingParams(temperature=1.0, max_tokens=12),
                       SamplingParams(temperature=0, max_tokens=5)])[0].outputs[0].token_ids
    assert alone == again
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=12, ignore_eos=True)
    n2 = _generate(engine, prompt, SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=12, ignore_eos=True))[0]
    assert n2.outputs[0].token_ids != n2.outputs[1].token_ids  # the completions of n > 1 differ
    assert _generate(engine, prompt, other_seed)[0].outputs[0].token_ids != alone


def test_abort_frees_blocks_and_length_cap(reference_only, engine):
    engine.add_request("to-abort", "Tell me a long story about dragons.", SamplingParams(max_tokens=200))
    engine.step()
    assert engine.stats()["kv_cache_blocks_free"] < engine.stats()["kv_cache_blocks_total"]
    engine.abort_request("to-abort")
    engine.abort_request("never-existed")  # no-op
    stats = engine.stats()
    assert stats["kv_cache_blocks_free"] == stats["kv_cache_blocks_total"] and not engine.has_unfinished_requests()
    # A prompt just under max_model_len: generation is capped and finishes with "length".
    prompt = [100 + (i % 50) for i in range(engine.config.max_model_len - 2)]
    c = _generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0].outputs[0]
    assert len(c.token_ids) == 2 and c.finish_reason == "length"
    c = _generate(engine, [prompt[:1] * engine.config.max_model_len], SamplingParams(temperature=0, max_tokens=5))[0]
    assert len(c.outputs[0].token_ids) == 1 and c.outputs[0].finish_reason == "length"


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_requests_raise_clear_errors(engine):
    with pytest.raises(ValueError, match="longer than max_model_len"):
        engine.add_request("long", [5] * (engine.config.max_model_len + 1), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", "", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty-ids", [], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, 49152\)"):
        engine.add_request("bad-ids", [1, 49152], SamplingParams())
    with pytest.raises(TypeError, match="prompt must be"):
        engine.add_request("bad-type", 3.5, SamplingParams())
    engine.add_request("dup", "hello", SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "hello", SamplingParams(max_tokens=1))
    engine.abort_request("dup")
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"n": 0}, "n must"), ({"logprobs": 21}, "logprobs"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"seed": 1.5}, "seed"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_models_raise_clear_errors(tmp_path, model_dir):
    with pytest.raises(FileNotFoundError, match="unknown model path"):
        LLMEngine(str(tmp_path / "missing"), device="cpu")
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported model architecture"):
        LLMEngine(str(tmp_path / "gpt2"), device="cpu")
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLMEngine(str(not_gguf), device="cpu")
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'bert'"):
        LLMEngine(str(tmp_path / "bert.gguf"), device="cpu")
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds"):
        LLMEngine(str(model_dir), device="cpu", max_model_len=100000)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLMEngine(str(model_dir), device="cpu", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLMEngine(str(model_dir), device="cpu", max_model_len=512, num_kv_blocks=8)


# ------------------------------------------------------------------------------------------------ fp8 KV
def test_fp8_kv_cache_on_cpu_takes_float32_activations_only():
    """fp8 pages on CPU are read by the C kernel under float32 activations (test_kv_cache_dtype.py runs an
    engine on them, projects/04's test_cpu_int8_pages.py holds the format); other activations are refused
    by name. The fp8 engine path on CUDA is tested in test_gpu.py."""
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' under dtype torch.bfloat16"):
        LLMEngine(None, **{**ENGINE_KWARGS, "dtype": "bfloat16", "kv_cache_dtype": "fp8"})


@pytest.mark.parametrize("rows", [1, 2, 7, 257])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_a_float64_reference_on_both_cpu_paths(rows, with_bias, monkeypatch):
    """CPU `Linear`: one row through F.linear on the row-major weight, more through oneDNN's blocked copy.
    Both must give x @ W.T + b for a stacked weight (Qwen2's q/k/v bias included), and the path taken must
    be the one the row count selects (the other is made to raise)."""
    import torch.nn.functional as F

    from kernel_lab.harness.testing import case_seed, randn
    from kernel_lab.models.layers import linear as llama_linear

    seed = case_seed("linear", rows, with_bias)
    x = randn((rows, 40), torch.float32, "cpu", seed)[:, :37]           # a strided input
    weight = randn((120, 37), torch.float32, "cpu", seed + 1)
    bias = randn((120,), torch.float32, "cpu", seed + 2) if with_bias else None
    expected = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
    linear = llama_linear.Linear(weight, bias)
    assert linear.blocked is not None, "this torch build has no oneDNN: the CPU engine runs F.linear only"

    def refuse(*args, **kwargs):
        raise AssertionError("wrong path for this row count")

    if rows == 1:
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", refuse)
    else:
        monkeypatch.setattr(F, "linear", refuse)
    out = linear(x)
    assert out.shape == (rows, 120) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qkv_bias,tied", [(False, True), (True, False)])
def test_the_checkpoint_table_drives_loading_random_weights_and_the_parameter_count(qkv_bias, tied):
    from kernel_lab.models.config import ModelConfig
    from kernel_lab.models.llama import build_model, checkpoint_shapes, random_state_dict

    arch = "Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"
    config = ModelConfig.from_hf({"architectures": [arch], "vocab_size": 50, "hidden_size": 24,
                                  "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "tie_word_embeddings": tied})
    state = random_state_dict(config, seed=3)
    assert {n: tuple(t.shape) for n, t in state.items()} == checkpoint_shapes(config)
    assert sum(t.numel() for t in state.values()) == config.num_parameters
    assert ("model.layers.1.self_attn.k_proj.bias" in state) == qkv_bias and ("lm_head.weight" in state) != tied
    bad = dict(state, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(41, 24)})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight has shape \(41, 24\), expected \(40, 24\)"):
        build_model(config, bad, torch.float32, "cpu", 32)
    with pytest.raises(ValueError, match="lacks 1 weight"):
        build_model(config, {n: t for n, t in state.items() if n != "model.norm.weight"}, torch.float32, "cpu", 32)
    build_model(config, state, torch.float32, "cpu", 32)
