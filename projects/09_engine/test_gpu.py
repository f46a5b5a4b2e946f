"""The engine on a CUDA device (skipped without one): project kernels on the hot path, CUDA graphs for
decode steps, no host synchronisation inside a step, and outputs that follow transformers in bf16.

Where the bundled model cannot be loaded (the bare GPU box has neither its package nor gguf and tokenizers)
the engine runs random weights of its shape on token-id prompts: every test but the transformers
comparison checks kernels, graphs and synchronisation, which need no trained weights."""

from __future__ import annotations

import pytest
import torch

from kernel_lab.engine import LLM, LLMEngine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.cuda_extension]

TEXT_PROMPTS = ["The capital of France is", "def quicksort(xs):", "Once upon a time, in a small village,",
                "The three laws of thermodynamics are", "1, 1, 2, 3, 5, 8,", "Water is made of",
                "A good cup of coffee needs", "In machine learning, overfitting means"]
KWARGS = dict(device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=16)


def _first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def graphs_engine(engine_model):
    return LLMEngine(engine_model, **KWARGS)


@pytest.fixture(scope="module")
def prompts(graphs_engine):
    """TEXT_PROMPTS as token ids with the bundled model; seeded random ids of similar lengths otherwise."""
    if graphs_engine.config.model_dir is not None:
        return [graphs_engine.tokenizer.encode(p) for p in TEXT_PROMPTS]
    g = torch.Generator().manual_seed(0)
    vocab = graphs_engine.config.vocab_size
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 7, 11, 9, 13, 4, 8, 10)]


def _greedy(engine, prompts, n=32):
    return [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(
        prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))]


def test_cuda_graphs_are_captured_and_follow_eager(graphs_engine, engine_model, prompts):
    assert graphs_engine.runner.graphs, "no CUDA graph was captured"
    eager = LLMEngine(engine_model, enforce_eager=True, **KWARGS)
    ours, ref = _greedy(graphs_engine, prompts), _greedy(eager, prompts)
    # Same kernels; only the GEMM shapes differ (graph buckets pad the batch), so bf16 rounding may flip a
    # near-tie late in a stream, never the first tokens of most prompts.
    agree = [_first_difference(a, b) for a, b in zip(ours, ref, strict=True)]
    assert sum(a == 32 for a in agree) >= 6 and min(agree) >= 4, agree


def test_decode_step_has_no_host_sync(graphs_engine, prompts):
    engine = graphs_engine
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(f"sync-{i}", prompt, params)
    for kind in ("prefill", "decode", "decode"):
        batch = engine.scheduler.schedule()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits, seqs = engine.runner.run_model(batch.items, engine.block_manager.drain_fresh_blocks())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert logits.shape[0] == len(seqs) > 0, kind
        results = engine.runner.sampler.sample(logits, seqs)
        engine.scheduler.update_computed(batch)
        for r in results:
            engine.output_processor.append_token(r)
    for i in range(3):
        engine.abort_request(f"sync-{i}")
    assert engine.stats()["kv_cache_blocks_free"] == engine.stats()["kv_cache_blocks_total"]


def test_bf16_greedy_follows_transformers(graphs_engine, bundled_model, prompts):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(graphs_engine.config.model_dir), dtype=torch.bfloat16).cuda().eval()
    model.generation_config.eos_token_id = None
    ours = _greedy(graphs_engine, prompts, 16)
    agree = []
    for prompt, tokens in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            ref = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
        agree.append(_first_difference(tokens, ref))
    assert sum(a == 16 for a in agree) >= 5 and sum(agree) >= 0.75 * 16 * len(prompts), agree


def test_fp8_kv_cache_on_cuda(graphs_engine, engine_model, prompts):
    fp8 = LLMEngine(engine_model, kv_cache_dtype="fp8", **KWARGS)
    ours, ref = _greedy(fp8, prompts), _greedy(graphs_engine, prompts)
    agree = [_first_difference(a, b) for a, b in zip(ours, ref, strict=True)]
    assert sum(agree) >= 0.5 * 32 * len(prompts), agree


def test_seeded_sampling_on_cuda_is_batch_independent(graphs_engine, prompts):
    params = SamplingParams(temperature=1.0, top_k=40, seed=11, max_tokens=16, ignore_eos=True)
    llm = LLM.from_engine(graphs_engine)
    alone = llm.generate(prompts[0], params)[0].outputs[0].token_ids
    batched = llm.generate(prompts[:4], [params] + [SamplingParams(temperature=0.7, max_tokens=16)] * 3)
    assert batched[0].outputs[0].token_ids == alone
