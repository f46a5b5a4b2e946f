"""n-gram speculation's pure parts: `--speculative-config` parsing (SpeculativeConfig) and the prompt-lookup
proposer against its brute-force definition."""

from __future__ import annotations

import random

import pytest

from kernel_lab.engine.ngram_proposer import propose_ngram, propose_ngram_reference
from kernel_lab.engine.speculative_config import SpeculativeConfig


def test_config_parses_vllm_json_and_dicts():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                                '"prompt_lookup_min": 2}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 4, 2)
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse(c) is c
    # vLLM's defaults for the bounds: one given stands for both, none is 5
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
                                   ).prompt_lookup_min == 3
    d = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (d.prompt_lookup_min, d.prompt_lookup_max) == (5, 5)
    assert d.disable_by_batch_size is None
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8}
                                   ).disable_by_batch_size == 8


@pytest.mark.parametrize("value, names", [
    ('{"method": "ngram"', "JSON"),
    ("[1]", "JSON object"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
    ({"model": "", "num_speculative_tokens": 4}, "speculative_config.model"),
    ({"model": 3, "num_speculative_tokens": 4}, "speculative_config.model"),
    ({"model": "/d.gguf", "method": "ngram", "num_speculative_tokens": 4}, "speculative_config.method"),
    ({"method": "draft_model", "num_speculative_tokens": 4}, "speculative_config.model"),
    ({"model": "/d.gguf", "num_speculative_tokens": 4, "weights": "int4"}, "speculative_config.weights"),
    ({"method": "ngram", "num_speculative_tokens": 4, "weights": "float32"}, "speculative_config.weights"),
    ({"method": "eagle", "num_speculative_tokens": 4}, "speculative_config.method"),
    ({"model": "/d.gguf", "num_speculative_tokens": 4, "acceptance_method": "typical_acceptance_sampler"},
     "speculative_config.acceptance_method"),
    ({"num_speculative_tokens": 4}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
])
def test_config_errors_name_the_key(value, names):
    with pytest.raises(ValueError, match=names):
        SpeculativeConfig.parse(value)


def test_draft_model_config():
    for value in ({"model": "/d.gguf", "num_speculative_tokens": 2},
                  {"model": "/d.gguf", "method": "draft_model", "num_speculative_tokens": 2, "weights": "auto"}):
        c = SpeculativeConfig.parse(value)
        assert (c.method, c.model, c.weights, c.num_speculative_tokens) == ("draft_model", "/d.gguf", "auto", 2)
    assert SpeculativeConfig.parse({"model": "/d.gguf", "num_speculative_tokens": 2, "weights": "float32"}
                                   ).weights == "float32"
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).model is None
    # vLLM's rejection sampler unless asked otherwise
    assert SpeculativeConfig.parse({"model": "/d.gguf", "num_speculative_tokens": 2}).rule == "rejection"
    assert SpeculativeConfig.parse({"model": "/d.gguf", "num_speculative_tokens": 2,
                                    "acceptance_method": "coupled"}).rule == "coupled"


@pytest.mark.parametrize("tokens, lo, hi, k, expected", [
    ([1, 2, 3, 4, 2, 3], 2, 3, 4, [4, 2, 3]),          # vLLM's docstring case: [2, 3] matches, 3 tokens follow
    ([1, 2, 3, 4, 2, 3], 3, 3, 4, []),                 # no earlier [4, 2, 3]
    ([5, 1, 2, 9, 1, 2, 7, 1, 2], 2, 2, 1, [9]),       # the earliest of two earlier occurrences
    ([5, 1, 2, 9, 3, 1, 2, 7, 3, 1, 2], 1, 3, 2, [7, 3]),  # the longest n wins over an earlier shorter match
    ([7, 7, 7, 7], 1, 2, 3, [7, 7]),                   # an occurrence may overlap the suffix
    ([1, 2, 3], 1, 4, 2, []),                          # nothing repeats
    ([4], 1, 1, 2, []),
    ([], 1, 1, 2, []),
    ([1, 2, 1, 2], 1, 2, 0, []),                       # k = 0
])
def test_proposer_hand_cases(tokens, lo, hi, k, expected):
    assert propose_ngram(tokens, lo, hi, k) == expected
    assert propose_ngram_reference(tokens, lo, hi, k) == expected


def test_proposer_matches_brute_force_on_random_contexts():
    rng = random.Random(1033)
    for _ in range(3000):
        alphabet = rng.randint(1, 5)                   # small alphabets: many repeats and ties
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(0, 40))]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        k = rng.randint(0, 6)
        assert propose_ngram(tokens, lo, hi, k) == propose_ngram_reference(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_speculative_config_flag_on_engine_commands():
    """--speculative-config comes from EngineConfig's field, so generate, serve and bench all take it."""
    import argparse

    from kernel_lab.engine.arg_utils import add_engine_arguments, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    raw = '{"method": "ngram", "num_speculative_tokens": 2}'
    kwargs = engine_kwargs(parser.parse_args(["--speculative-config", raw]))
    assert SpeculativeConfig.parse(kwargs["speculative_config"]).num_speculative_tokens == 2
    assert engine_kwargs(parser.parse_args([]))["speculative_config"] is None
