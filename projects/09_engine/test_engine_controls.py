"""The sampling controls and structured outputs wired through the real engine (the bundled SmolLM2, fp32
on CPU): each control changes the output when it should and nothing when neutral; seeded sampling with
processors stays batch-invariant; regex and choice outputs always match at temperature >= 1; a JSON schema
yields JSON that satisfies it; n > 1 advances one matcher per sequence; a grammar that fails to compile
ends its request with the error and leaves every block in the pool."""

from __future__ import annotations

import json
import re

import pytest

from kernel_lab.engine import LLMEngine, SamplingParams
from kernel_lab.engine.structured_output import make_spec

pytestmark = pytest.mark.usefixtures("one_cpu_thread", "reference_only")
pytest.importorskip("xgrammar")

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The"


@pytest.fixture(scope="module")
def engine(bundled_model):
    return LLMEngine(None, dtype="float32", device="cpu", weights="float32", max_model_len=256, max_num_seqs=8,
                     num_kv_blocks=48, max_num_batched_tokens=128, block_size=16)


def _run(engine, prompts, params):
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert engine.stats()["kv_cache_blocks_free"] == engine.block_manager.num_blocks
    return [final[f"r{i}"] for i in range(len(prompts))]


def _ids(engine, prompt, **kw):
    return _run(engine, [prompt], SamplingParams(max_tokens=kw.pop("max_tokens", 12), **kw))[0].outputs[0].token_ids


def test_neutral_controls_change_nothing_and_active_ones_act(engine):
    greedy = _ids(engine, PROMPT, temperature=0, ignore_eos=True)
    neutral = dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias={}, min_p=0.0,
                   min_tokens=0)
    assert _ids(engine, PROMPT, temperature=0, ignore_eos=True, **neutral) == greedy
    # the prompt repeats itself and greedy repeats it again (the output repeats its own tokens by its second
    # sentence): the penalties break the repetition
    long = _ids(engine, PROMPT, temperature=0, ignore_eos=True, max_tokens=30)
    for penalty in (dict(repetition_penalty=1.8), dict(presence_penalty=2.0), dict(frequency_penalty=2.0)):
        assert _ids(engine, PROMPT, temperature=0, ignore_eos=True, max_tokens=30, **penalty) != long, penalty
    banned = greedy[0]
    biased = _ids(engine, PROMPT, temperature=0, ignore_eos=True, logit_bias={banned: -100})
    assert biased[0] != banned
    assert _ids(engine, PROMPT, temperature=0, ignore_eos=True, logit_bias={7: 100})[:3] == [7, 7, 7]
    assert set(_ids(engine, PROMPT, temperature=0, ignore_eos=True, allowed_token_ids=[11, 12])) <= {11, 12}
    word = engine.tokenizer.decode([greedy[0]]).strip()
    assert _ids(engine, PROMPT, temperature=0, ignore_eos=True, bad_words=[word])[0] != greedy[0]


def test_min_tokens_holds_eos_back_and_min_p_narrows(engine):
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    short = _run(engine, [chat], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert short.finish_reason == "stop"
    n = len(short.token_ids)
    held = _run(engine, [chat], SamplingParams(temperature=0, max_tokens=n + 8, min_tokens=n + 4))[0].outputs[0]
    assert len(held.token_ids) >= n + 4 and held.token_ids[:n - 1] == short.token_ids[:n - 1]
    # min_p = 1 keeps only the most likely token: sampling at a high temperature becomes greedy
    greedy = _ids(engine, PROMPT, temperature=0, ignore_eos=True)
    assert _ids(engine, PROMPT, temperature=1.5, seed=3, min_p=1.0, ignore_eos=True) == greedy
    assert _ids(engine, PROMPT, temperature=1.5, seed=3, ignore_eos=True) != greedy


def test_seeded_sampling_with_processors_is_batch_invariant(engine):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True, repetition_penalty=1.3,
                            logit_bias={13: 5.0}, min_p=0.05, structured_outputs=make_spec("regex", "[a-z ]+", "x"))
    alone = _run(engine, [PROMPT], params)[0].outputs[0].token_ids
    mixed = _run(engine, ["Hello", PROMPT, "Count: 1, 2,"],
                 [SamplingParams(temperature=0.7, max_tokens=6), params, SamplingParams(temperature=0, max_tokens=8,
                                                                                         frequency_penalty=1.0)])
    assert mixed[1].outputs[0].token_ids == alone


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regex_and_choice_always_match_at_temperature_one(engine, seed):
    regex = make_spec("regex", r"[0-9]{3}-[a-z]{2,4}", "structured_outputs.regex")
    choice = make_spec("choice", ["red", "green", "light blue"], "structured_outputs.choice")
    outs = _run(engine, ["My code is", "My favourite colour is"],
                [SamplingParams(n=2, temperature=1.2, seed=seed, max_tokens=20, structured_outputs=regex),
                 SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=20, structured_outputs=choice)])
    for out in outs[0].outputs:
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", out.text), out.text
        assert out.finish_reason == "stop"
    for out in outs[1].outputs:
        assert out.text in ("red", "green", "light blue") and out.finish_reason == "stop"


def test_json_schema_output_parses_and_satisfies_it(engine):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}])
    out = _run(engine, [chat], SamplingParams(temperature=0, max_tokens=60,
                                              structured_outputs=make_spec("json", schema, "x")))[0].outputs[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), schema)


def test_a_grammar_that_fails_ends_the_request_and_frees_everything(engine):
    bad = SamplingParams(max_tokens=5, structured_outputs=make_spec("regex", "(unclosed", "guided_regex"))
    engine.add_request("bad", PROMPT, bad)
    engine.add_request("good", PROMPT, SamplingParams(temperature=0, max_tokens=3))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["bad"].error is not None and "guided_regex" in str(final["bad"].error)
    assert final["good"].error is None and len(final["good"].outputs[0].token_ids) == 3
    assert engine.stats()["kv_cache_blocks_free"] == engine.block_manager.num_blocks
    assert engine.stats()["num_waiting"] == 0


def test_bad_control_values_name_the_parameter(engine):
    for kwargs, name in ((dict(presence_penalty=3), "presence_penalty"), (dict(repetition_penalty=0), "repetition"),
                         (dict(min_p=1.5), "min_p"), (dict(min_tokens=20, max_tokens=5), "min_tokens"),
                         (dict(bad_words="x"), "bad_words")):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("x", PROMPT, SamplingParams(logit_bias={10**6: 1.0}))
    assert "x" not in engine.requests


def test_prompt_logprobs_score_every_prompt_token_after_the_first(engine):
    prompt = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = engine.tokenizer.encode(prompt)
    _run(engine, [prompt], SamplingParams(temperature=0, max_tokens=2))   # fills the prefix cache
    hits_before = engine.stats()["prefix_cache_hits"]
    (out,) = _run(engine, [prompt], SamplingParams(max_tokens=0, prompt_logprobs=2))
    assert engine.stats()["prefix_cache_hits"] == hits_before  # no cache reads for a scored prompt
    lps = out.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None and out.outputs[0].token_ids == []
    assert out.outputs[0].finish_reason == "length"
    assert all(len(lps[i]) in (2, 3) and ids[i] in lps[i] for i in range(1, len(ids)))
    # the reference: the raw logprob of token ids[i] after ids[:i], as generation reports it (the token
    # forced by allowed_token_ids, whose logprobs are taken before the processors)
    for i in (1, 4, len(ids) - 1):
        forced = SamplingParams(temperature=0, max_tokens=1, logprobs=0, allowed_token_ids=[ids[i]])
        (gen,) = _run(engine, [ids[:i]], forced)
        expect = gen.outputs[0].logprobs[0][ids[i]]
        assert lps[i][ids[i]].logprob == pytest.approx(expect.logprob, abs=1e-3)
        assert lps[i][ids[i]].rank == expect.rank
