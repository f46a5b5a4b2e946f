"""Stop strings (issue 31): the hold-back (the text that could still become a stop string and is not shown
yet) equals a brute-force reference on fresh random text, costs each step its new characters only whatever
the stop strings' lengths, and stop strings count only once min_tokens tokens were generated (vLLM)."""

from __future__ import annotations

import os
import random
import time

import pytest

from kernel_lab.engine import SamplingParams
from kernel_lab.engine.output_processor import OutputProcessor, StopPrefixes
from kernel_lab.engine.sampler import SampleResult
from kernel_lab.engine.sequence import Request, SequenceStatus


def _holdback_reference(text: str, stops: list[str]) -> int:
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


def test_the_holdback_matches_a_brute_force_reference_on_random_text():
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    for _ in range(300):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 7))) for _ in range(rng.randint(1, 4))]
        prefixes, text = StopPrefixes.for_stops(stops), ""
        for _ in range(rng.randint(1, 12)):
            piece = "".join(rng.choices("abc", k=rng.randint(1, 3)))
            text += piece
            prefixes.feed(piece)
            assert prefixes.holdback() == _holdback_reference(text, stops), (seed, stops, text)


LONG_TOKEN = 1    # one token of 1,100 "a"s: a text longer than any stop string in one step


class _CharTokenizer:
    """One character per token id (id = code point) but LONG_TOKEN; no specials but EOS 0."""

    eos_token_ids = {0}

    def decode(self, ids, skip_special_tokens=True):
        return "".join("a" * 1100 if i == LONG_TOKEN else chr(i) for i in ids if i)


def _generate(params: SamplingParams, text: str, first: list[int] = ()) -> tuple[Request, float]:
    """Feed the tokens `first`, then `text` one character token at a time, through an OutputProcessor,
    building an output every step as a stream does; (the request, seconds spent on `text`)."""
    processor = OutputProcessor(_CharTokenizer(), 10**6, lambda seq: setattr(seq, "status", SequenceStatus.FINISHED))
    request = Request("r", None, [ord(" ")], params, 0)
    processor.add_request(request)
    seq = request.seqs[0]
    seq.status = SequenceStatus.RUNNING
    for token in first:
        processor.process([SampleResult(seq, token)])
    start = time.perf_counter()
    for char in text:
        processor.process([SampleResult(seq, ord(char))])
        if seq.is_finished:
            break
    return request, time.perf_counter() - start


def test_the_holdback_costs_the_new_characters_not_the_stop_lengths():
    # 16 stop strings of 1,024 characters that never match a run of "a", after a text longer than them:
    # trying every prefix against the tail each step cost 16 * 1023 slices of up to 1,023 characters per
    # step: 1.8 s for these 200 steps here, against 0.02 s now
    stops = [chr(ord("b") + i) + "a" * 1023 for i in range(16)]
    request, seconds = _generate(SamplingParams(max_tokens=1000, stop=stops), "a" * 200, first=[LONG_TOKEN])
    out = request.seqs[0].output
    assert out.text.length == out.emitted_chars == 1300     # no "a" can start a stop string: all shown
    assert seconds < 0.3, f"{seconds:.3f} s for 200 steps"


def test_stop_strings_count_only_past_min_tokens():
    text = "ab. cd. efghijklmnop. rest"
    request, _ = _generate(SamplingParams(max_tokens=40, stop=["."]), text)
    assert request.seqs[0].output.text.read(0) == "ab" and request.seqs[0].stop_reason == "."
    request, _ = _generate(SamplingParams(max_tokens=40, stop=["."], min_tokens=12), text)
    seq = request.seqs[0]
    # the first stop string past token 12 ends it; those before are plain text
    assert seq.output.text.read(0) == "ab. cd. efghijklmnop" and seq.finish_reason == "stop"
    assert seq.num_output_tokens == text.index("p.") + 2


@pytest.fixture(scope="module")
def engine(bundled_model):
    from kernel_lab.engine import LLMEngine

    return LLMEngine(None, dtype="float32", device="cpu", weights="float32", max_model_len=128, max_num_seqs=4,
                     num_kv_blocks=16, block_size=16)


@pytest.mark.usefixtures("one_cpu_thread", "reference_only")
def test_min_tokens_12_with_a_period_stop_on_the_model(engine):
    """The issue's request: min_tokens 12 with stop ["."] finished after 2 tokens."""
    def run(**kw):
        engine.add_request("m", "The capital of France is Paris. The capital of Germany is", SamplingParams(temperature=0, max_tokens=30, stop=["."], **kw))
        final = None
        while engine.has_unfinished_requests():
            final = next((o for o in engine.step() if o.finished), final)
        return final.outputs[0]

    free = run()
    assert free.stop_reason == "." and len(free.token_ids) < 12, free   # the model writes "." early
    held = run(min_tokens=12)
    assert len(held.token_ids) > 12 and "." in held.text[:len(free.text) + 1], held
