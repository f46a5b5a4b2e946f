"""SamplingParams is the one place a request's values are checked (issue 31, item 2): each refusal is a
RequestFieldError naming the field (the server's 400 takes `param` from it); `verify` checks every field that
holds token ids, the prompt's among them, against the model's vocabulary, at its edges; the sizes a client
controls are bounded; and the engine's add_request refuses through it without keeping any of the request."""

from __future__ import annotations

import pytest

from kernel_lab.engine import SamplingParams
from kernel_lab.engine.errors import RequestFieldError
from kernel_lab.engine.sampling_params import (
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

VOCAB = 1000


@pytest.mark.parametrize("field,kwargs", [
    ("n", dict(n=0)), ("temperature", dict(temperature=-1)), ("top_p", dict(top_p=0)), ("top_k", dict(top_k=-2)),
    ("seed", dict(seed=1.5)), ("max_tokens", dict(max_tokens=0)), ("logprobs", dict(logprobs=21)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)), ("presence_penalty", dict(presence_penalty=3)),
    ("frequency_penalty", dict(frequency_penalty=float("nan"))), ("repetition_penalty", dict(repetition_penalty=0)),
    ("min_p", dict(min_p=2)), ("min_tokens", dict(min_tokens=5, max_tokens=4)),
    ("logit_bias", dict(logit_bias={"x": 1})), ("logit_bias", dict(logit_bias={3: 101})),
    ("logit_bias", dict(logit_bias={-1: 1})), ("allowed_token_ids", dict(allowed_token_ids=[])),
    ("stop_token_ids", dict(stop_token_ids=[-1])), ("stop_token_ids", dict(stop_token_ids="12")),
    ("stop", dict(stop=[""])), ("stop", dict(stop=["a"] * (MAX_STOP_STRINGS + 1))),
    ("stop", dict(stop="x" * (MAX_STOP_STRING_CHARS + 1))), ("stop", dict(stop=["ok", 3])),
    ("stop_token_ids", dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))),
    ("bad_words", dict(bad_words=["w"] * (MAX_BAD_WORDS + 1))),
    ("bad_words", dict(bad_words=["w" * (MAX_BAD_WORD_CHARS + 1)])), ("bad_words", dict(bad_words="word")),
    ("bad_words", dict(bad_words=["ok", "\ud800"])), ("stop", dict(stop="a\udfff")),
    ("structured_outputs", dict(structured_outputs={"regex": "a"})),
])
def test_each_refusal_names_its_field(field, kwargs):
    with pytest.raises(RequestFieldError) as caught:
        SamplingParams(**kwargs)
    assert caught.value.param == field and field in str(caught.value)


def test_the_caps_are_inclusive():
    SamplingParams(stop=["s" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                   stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
                   bad_words=["w" * MAX_BAD_WORD_CHARS] * MAX_BAD_WORDS)


@pytest.mark.parametrize("field", ["stop_token_ids", "logit_bias", "allowed_token_ids", "prompt"])
def test_verify_checks_every_token_id_field_at_the_vocabulary_edge(field):
    def verify(token):
        ids = {"stop_token_ids": dict(stop_token_ids=[token]), "logit_bias": dict(logit_bias={str(token): 1.0}),
               "allowed_token_ids": dict(allowed_token_ids=[token]), "prompt": {}}[field]
        SamplingParams(**ids).verify(VOCAB, 64, [token] if field == "prompt" else [5])

    verify(0)
    verify(VOCAB - 1)
    for token in (VOCAB, 10**9):
        with pytest.raises(RequestFieldError) as caught:
            verify(token)
        assert caught.value.param == field and str(VOCAB) in str(caught.value)


def test_verify_checks_the_prompt_length():
    SamplingParams().verify(VOCAB, 4, [1, 2, 3, 4])
    with pytest.raises(RequestFieldError) as caught:
        SamplingParams().verify(VOCAB, 4, [1, 2, 3, 4, 5])
    assert caught.value.param == "prompt"


@pytest.fixture(scope="module")
def engine(bundled_model):
    from kernel_lab.engine import LLMEngine

    return LLMEngine(None, dtype="float32", device="cpu", weights="float32", max_model_len=64, max_num_seqs=4,
                     num_kv_blocks=16, block_size=16)


@pytest.mark.parametrize("prompt,kwargs,field", [
    ("Hello", dict(min_tokens=2, max_tokens=4, stop_token_ids=[1_000_000_000]), "stop_token_ids"),  # issue 31
    ("Hello", dict(logit_bias={49152: 1.0}), "logit_bias"),
    ("Hello", dict(allowed_token_ids=[1, 49152]), "allowed_token_ids"),
    ([1, 2, 49152], {}, "prompt"),
    ([1] * 65, {}, "prompt"),
    ("", {}, "prompt"),
])
def test_add_request_refuses_through_verify_and_keeps_nothing(engine, prompt, kwargs, field):
    with pytest.raises(RequestFieldError) as caught:
        engine.add_request("r", prompt, SamplingParams(**kwargs))
    assert caught.value.param == field
    assert not engine.requests and not engine.scheduler.waiting and not engine.structured_outputs.waiting
    engine.add_request("r", "Hello", SamplingParams(max_tokens=2))   # the id is free, the engine serves
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
