"""Sampling controls as batched tensor ops (kernel_lab/engine/logits_processors.py), each against a plain-Python
reference that loops over rows and tokens in float64, each shown to act when it should and to change nothing
when neutral."""

from __future__ import annotations

import math
import random

import pytest
import torch

import kernel_lab.engine.logits_processors as lp
from kernel_lab.engine.logits_processors import SamplingControls, apply_logits_processors, build_logits_state

VOCAB = 50
NEG_INF = float("-inf")


# --- the plain-Python reference -------------------------------------------------------------------------
def reference(logits: torch.Tensor, controls, prompts, outputs) -> list[list[float]]:
    """vLLM's order, one row and one token at a time, in Python floats."""
    result = []
    for row, c, prompt, output in zip(logits.double().tolist(), controls, prompts, outputs):
        x = list(row)
        if c is None:
            result.append(x)
            continue
        if c.allowed_token_ids is not None:
            x = [v if t in c.allowed_token_ids else NEG_INF for t, v in enumerate(x)]
        for word in c.bad_words:
            k = len(word) - 1
            if k == 0 or (len(output) >= k and list(output[-k:]) == list(word[:-1])):
                x[word[-1]] = NEG_INF
        if len(output) < c.min_tokens:
            for t in c.stop_token_ids:
                x[t] = NEG_INF
        for t, b in (c.logit_bias or {}).items():
            x[t] += b
        for t in range(len(x)):
            if t in prompt or t in output:
                x[t] = x[t] / c.repetition_penalty if x[t] > 0 else x[t] * c.repetition_penalty
            n = output.count(t)
            x[t] -= c.frequency_penalty * n + c.presence_penalty * (n > 0)
        result.append(x)
    return result


def assert_matches(actual: torch.Tensor, want: list[list[float]]) -> None:
    want = torch.tensor(want, dtype=torch.float64)
    a = actual.double().cpu()
    assert torch.equal(torch.isneginf(a), torch.isneginf(want)), "the -inf entries differ"
    finite = ~torch.isneginf(want)
    torch.testing.assert_close(a[finite], want[finite], rtol=1e-6, atol=1e-5)


def random_batch(seed: int, rows: int = 6):
    rng = random.Random(seed)
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))] for _ in range(rows)]
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 10))] for _ in range(rows)]
    return logits, prompts, outputs, rng


def run(logits, controls, prompts, outputs):
    state = build_logits_state(controls, prompts, outputs, VOCAB)
    return apply_logits_processors(logits.clone(), state), state


ONE_AT_A_TIME = {
    "presence_penalty": lambda rng, out: dict(presence_penalty=rng.uniform(-2, 2)),
    "frequency_penalty": lambda rng, out: dict(frequency_penalty=rng.uniform(-2, 2)),
    "repetition_penalty": lambda rng, out: dict(repetition_penalty=rng.choice([0.5, 1.3, 2.0])),
    "logit_bias": lambda rng, out: dict(logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(4)}),
    "min_tokens": lambda rng, out: dict(min_tokens=len(out) + rng.choice([-1, 1]), stop_token_ids=(0, 7)),
    "allowed_token_ids": lambda rng, out: dict(allowed_token_ids=tuple(sorted(rng.sample(range(VOCAB), 5)))),
    "bad_words": lambda rng, out: dict(bad_words=((rng.randrange(VOCAB),), tuple(out[-2:]) + (9,),
                                                  (out[-1] if out else 3, 11) if rng.random() < 0.5 else (4, 12))),
}


@pytest.mark.parametrize("name", ONE_AT_A_TIME)
def test_each_processor_matches_the_reference(name):
    for seed in range(4):
        logits, prompts, outputs, rng = random_batch(seed)
        controls = [None if r == 2 else SamplingControls(**ONE_AT_A_TIME[name](rng, outputs[r]))
                    for r in range(len(prompts))]
        got, _ = run(logits, controls, prompts, outputs)
        assert_matches(got, reference(logits, controls, prompts, outputs))
        assert torch.equal(got[2], logits[2])  # the row without controls is untouched


def test_all_processors_together_follow_vllms_order():
    for seed in range(6):
        logits, prompts, outputs, rng = random_batch(seed, rows=5)
        controls = []
        for r in range(5):
            kwargs = {}
            for make in ONE_AT_A_TIME.values():
                if rng.random() < 0.6:
                    kwargs.update(make(rng, outputs[r]))
            controls.append(SamplingControls(**kwargs))
        got, _ = run(logits, controls, prompts, outputs)
        assert_matches(got, reference(logits, controls, prompts, outputs))


def test_neutral_controls_change_nothing_and_build_nothing():
    logits, prompts, outputs, _ = random_batch(1)
    neutral = [SamplingControls(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias={},
                                min_tokens=0, stop_token_ids=(0,), bad_words=()) for _ in prompts]
    got, state = run(logits, neutral, prompts, outputs)
    assert torch.equal(got, logits)
    assert all(v is None for v in vars(state).values())
    assert torch.equal(run(logits, [SamplingControls(logit_bias={3: 0.0})] * 6, prompts, outputs)[0], logits)


@pytest.mark.parametrize("kwargs, token, direction", [
    (dict(presence_penalty=1.0), 5, -1), (dict(presence_penalty=-1.0), 5, +1),
    (dict(frequency_penalty=0.5), 5, -1), (dict(repetition_penalty=1.5), 5, -1),
    (dict(repetition_penalty=1.5), 8, -1),  # a prompt token is penalised too
    (dict(logit_bias={20: 5.0}), 20, +1), (dict(logit_bias={"21": -5.0}), 21, -1),
])
def test_each_control_acts_when_it_should(kwargs, token, direction):
    logits = torch.full((1, VOCAB), 2.0)
    kwargs = {k: (lp.validate_logit_bias(v, VOCAB) if k == "logit_bias" else v) for k, v in kwargs.items()}
    got, _ = run(logits, [SamplingControls(**kwargs)], [[8]], [[5, 5, 6]])
    changed = torch.nonzero(got[0] != logits[0]).flatten().tolist()
    assert token in changed and (got[0, token] - logits[0, token]).sign() == direction
    untouched = [t for t in range(VOCAB) if t not in (5, 6, 8, 20, 21)]
    assert torch.equal(got[0, untouched], logits[0, untouched])


def test_frequency_penalty_counts_repeats_and_presence_does_not():
    logits = torch.zeros(2, VOCAB)
    got, _ = run(logits, [SamplingControls(frequency_penalty=0.5), SamplingControls(presence_penalty=0.5)],
                 [[], []], [[5, 5, 5, 6], [5, 5, 5, 6]])
    assert got[0, 5] == -1.5 and got[0, 6] == -0.5 and got[1, 5] == got[1, 6] == -0.5


def test_min_tokens_holds_stop_tokens_back_until_reached():
    logits = torch.zeros(2, VOCAB)
    controls = [SamplingControls(min_tokens=3, stop_token_ids=(2, 7))] * 2
    got, _ = run(logits, controls, [[], []], [[4, 4], [4, 4, 4]])
    assert got[0, 2] == got[0, 7] == NEG_INF and int(torch.isneginf(got[0]).sum()) == 2
    assert torch.equal(got[1], logits[1])  # three tokens generated: EOS allowed again


def test_multi_token_bad_words_ban_only_after_their_prefix():
    logits = torch.zeros(3, VOCAB)
    words = ((10, 11, 12), (30,))
    got, _ = run(logits, [SamplingControls(bad_words=words)] * 3, [[10, 11]] * 3, [[1, 10, 11], [10, 1], []])
    assert got[0, 12] == NEG_INF and got[0, 30] == NEG_INF
    assert got[1, 12] == 0 and got[1, 30] == NEG_INF  # prefix not at the end of the output
    assert got[2, 12] == 0  # the prompt does not count (vLLM matches the output)


def test_allowed_token_ids_keep_only_those():
    logits = torch.randn(2, VOCAB)
    got, _ = run(logits, [SamplingControls(allowed_token_ids=(3, 40)), None], [[], []], [[], []])
    assert torch.nonzero(~torch.isneginf(got[0])).flatten().tolist() == [3, 40]
    assert torch.equal(got[1], logits[1])


def test_min_p_matches_its_softmax_definition():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, VOCAB, generator=gen) * 2
    min_p = torch.tensor([0.0, 0.05, 0.3, 1.0, 0.2])
    temperature = torch.tensor([1.0, 0.7, 1.5, 1.0, 0.0])
    got = logits.clone()
    lp.apply_min_p(got, min_p, temperature)
    for r in range(5):
        if min_p[r] == 0 or temperature[r] == 0:
            assert torch.equal(got[r], logits[r])  # neutral, and greedy rows are left alone
            continue
        probs = torch.softmax(logits[r].double() / float(temperature[r]), 0)
        keep = probs >= float(min_p[r]) * probs.max()
        assert torch.equal(~torch.isneginf(got[r]), keep), r
        assert torch.equal(got[r][keep], logits[r][keep])
    assert int((~torch.isneginf(got[3])).sum()) == 1  # min_p = 1 keeps the argmax only


def test_state_covers_only_the_rows_that_use_each_processor():
    controls = [None, SamplingControls(presence_penalty=0.5), SamplingControls(min_p=0.1), None]
    state = build_logits_state(controls, [[1]] * 4, [[2]] * 4, VOCAB)
    assert state.penalties.rows.tolist() == [1, 1] and state.penalties.tokens.tolist() == [1, 2]
    assert state.penalties.counts.tolist() == [0.0, 1.0]  # token 1 only in the prompt
    assert state.min_p.tolist() == pytest.approx([0, 0, 0.1, 0])
    assert state.bias is None and state.allowed_rows is None
    with pytest.raises(ValueError, match="one entry per batch row"):
        build_logits_state(controls, [[1]] * 3, [[2]] * 4, VOCAB)


@pytest.mark.parametrize("call, pattern", [
    (lambda: lp.validate_presence_penalty(2.5), r"presence_penalty must be in \[-2, 2\]"),
    (lambda: lp.validate_frequency_penalty(-2.01), r"frequency_penalty must be in \[-2, 2\]"),
    (lambda: lp.validate_frequency_penalty(float("nan")), "frequency_penalty must be a finite number"),
    (lambda: lp.validate_repetition_penalty(0.0), "repetition_penalty must be > 0"),
    (lambda: lp.validate_repetition_penalty("1"), "repetition_penalty must be a finite number"),
    (lambda: lp.validate_min_p(1.5), r"min_p must be in \[0, 1\]"),
    (lambda: lp.validate_min_tokens(-1), "min_tokens must be an integer >= 0"),
    (lambda: lp.validate_min_tokens(9, max_tokens=8), r"min_tokens \(9\) must be <= max_tokens \(8\)"),
    (lambda: lp.validate_logit_bias({"5": 101}, VOCAB), r"logit_bias values must be in \[-100, 100\]"),
    (lambda: lp.validate_logit_bias({VOCAB: 1}, VOCAB), r"logit_bias token ids must be integers in \[0, 50\)"),
    (lambda: lp.validate_logit_bias({"x": 1}, VOCAB), "logit_bias keys must be token ids"),
    (lambda: lp.validate_logit_bias([1], VOCAB), "logit_bias must be an object"),
    (lambda: lp.validate_allowed_token_ids([], VOCAB), "allowed_token_ids must be a non-empty list"),
    (lambda: lp.validate_allowed_token_ids([-1], VOCAB), "allowed_token_ids token ids must be integers"),
    (lambda: lp.validate_bad_words_token_ids([[]], VOCAB), "bad_words entries must be non-empty"),
])
def test_validation_names_the_parameter(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


def test_validation_accepts_the_edges():
    assert lp.validate_presence_penalty(-2) == -2.0 and lp.validate_frequency_penalty(2) == 2.0
    assert lp.validate_min_p(0) == 0.0 and lp.validate_min_p(1) == 1.0
    assert lp.validate_logit_bias({"3": -100, 4: 100.0}, VOCAB) == {3: -100.0, 4: 100.0}
    assert lp.validate_allowed_token_ids([5, 3, 5], VOCAB) == (3, 5)
    assert math.isclose(lp.validate_repetition_penalty(1e-3), 1e-3)


@pytest.mark.gpu
def test_cuda_matches_cpu():
    for seed in range(3):
        logits, prompts, outputs, rng = random_batch(seed)
        controls = [SamplingControls(**{k: v for make in ONE_AT_A_TIME.values() for k, v in make(rng, o).items()})
                    for o in outputs]
        cpu, _ = run(logits, controls, prompts, outputs)
        state = build_logits_state(controls, prompts, outputs, VOCAB, device="cuda")
        gpu = apply_logits_processors(logits.cuda(), state)
        assert_matches(gpu, cpu.double().tolist())


def test_rows_do_not_depend_on_the_batch():
    # Seeded sampling stays batch-invariant only if each row's processed logits are its own business.
    logits, prompts, outputs, rng = random_batch(7)
    controls = [SamplingControls(**{k: v for make in ONE_AT_A_TIME.values() for k, v in make(rng, o).items()})
                for o in outputs]
    together, _ = run(logits, controls, prompts, outputs)
    for r in range(len(controls)):
        alone, _ = run(logits[r:r + 1], controls[r:r + 1], prompts[r:r + 1], outputs[r:r + 1])
        assert torch.equal(alone[0], together[r])
