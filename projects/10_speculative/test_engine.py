"""n-gram speculation in the engine, on the bundled SmolLM2 (fp32 on CPU, prefix caching on): greedy output
identical token for token to decoding without speculation for 32+ concurrent prompts, with drafts accepted;
a seeded sampled request identical at k=2, k=5 and without; the verify rows' logits equal to 1-row decode's
at the same position and context; aborts mid-speculation leave no block held; no sequence holds a block
past its length after a step."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kernel_lab.engine import LLMEngine, SamplingParams
from kernel_lab.engine.block_manager import chain_hash
from kernel_lab.engine.speculative import (
    DEFAULT_ROW_COST,
    PROBE_INTERVAL,
    DraftPosition,
    DraftState,
    NoSpeculation,
    Speculator,
    StepCost,
    draft_length,
)
from kernel_lab.engine.speculative_config import SpeculativeConfig
from kernel_lab.harness.testing import chi_square_pvalue

ALPHA = 1e-3   # test_correctness.py's level for its chi-square checks

pytestmark = pytest.mark.usefixtures("one_thread", "reference_only")

# repetition, so prompt lookup finds n-grams whose continuation the model does follow
BASE = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "a b c a b c a b c a b", "The cat sat on the mat. The cat sat on the",
        "red green blue red green blue red", "Monday Tuesday Wednesday Monday Tuesday",
        "one two three four one two three four one", "x = x + 1\nx = x + 1\nx = x +",
        "I like tea. I like coffee. I like"]
PROMPTS = [p if i < len(BASE) else f"{i}: {p}" for i, p in enumerate(BASE * 4)]     # 32, shared prefixes


def _missing() -> str | None:
    try:
        import gguf  # noqa: F401
        import tokenizers  # noqa: F401

        from kernel_lab.models.gguf import default_model_path

        default_model_path()
    except (ImportError, FileNotFoundError) as exc:
        return f"the bundled model cannot be loaded on this machine: {exc}"
    return None


@pytest.fixture(scope="module")
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def engine():
    reason = _missing()
    if reason:
        pytest.skip(reason)
    return LLMEngine(None, dtype="float32", device="cpu", weights="float32", max_model_len=128, max_num_seqs=40,
                     num_kv_blocks=160, max_num_batched_tokens=256, block_size=16, enable_prefix_caching=True,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                         "prompt_lookup_min": 1})


def _speculator(engine, k):
    """k: None (off), a draft count (n-gram), or a Speculator as it is (a draft model's)."""
    if k is None:
        return NoSpeculation()
    if isinstance(k, Speculator):
        return k
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
                                 "prompt_lookup_min": 1})
    return Speculator(c, engine.config.max_model_len)


def _assert_idle(engine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting


def _assert_tight(engine) -> None:
    """After a step no sequence holds a block past its tokens (rejected drafts' blocks were given back),
    and the prefix cache holds only computed blocks of real tokens (no rejected draft entered it)."""
    bm, bs = engine.block_manager, engine.block_manager.block_size
    assert not any(seq.draft_token_ids for seq in engine.scheduler.waiting)     # preempted: drafts dropped
    # per-sequence draft lengths: at most one per sequence that ran this step (they are not a leak)
    assert len(getattr(engine.speculator, "draft_len", {})) <= engine.config.max_num_seqs
    for seq in engine.scheduler.running:
        assert not seq.draft_token_ids
        assert len(seq.block_table) <= bm.blocks_for(seq.num_tokens), seq.seq_id
        assert seq.num_computed_tokens < seq.num_tokens, seq.seq_id
        assert seq.num_committed_blocks * bs <= seq.num_computed_tokens, seq.seq_id
        parent = None
        for i, h in enumerate(seq.block_hashes):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            assert len(tokens) == bs and h == chain_hash(parent, tokens), (seq.seq_id, i)
            parent = h
        for i in range(seq.num_committed_blocks):
            block = bm.blocks[seq.block_table[i]]     # unregistered (None) where the cache had it already
            assert block.token_ids in (None, tuple(seq.token_ids[i * bs:(i + 1) * bs])), (seq.seq_id, i)


def _run(engine, prompts, params, k: int | None, abort=None, verified: list | None = None) -> dict:
    """Every request to its end; `verified` (if given) collects (constrained?, drafts, accepted) per verify."""
    engine.speculator = _speculator(engine, k)
    if verified is not None:
        _record_verifies(engine.speculator, verified)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params[i % len(params)])
    final, steps = {}, 0
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            steps += 1
            _assert_tight(engine)
            if abort is not None:
                abort(engine, steps)
        _assert_idle(engine)
        engine.speculator.propose([])      # the next step's proposal forgets every finished sequence
        assert not getattr(engine.speculator, "draft_len", {})
        draft = getattr(getattr(engine.speculator, "proposer", None), "block_manager", None)
        if draft is not None:               # a draft model's pool is whole again too
            assert not engine.speculator.proposer.shadows and draft.num_free_blocks == draft.num_blocks
    finally:    # a failed check leaves the module's engine clean for the next test
        for rid in list(engine.requests):
            engine.abort_request(rid)
    return final


def _record_verifies(speculator, verified: list) -> None:
    original = speculator.rollback

    def rollback(batch, block_manager, running):
        for seq, _ in batch.items:
            if seq.draft_token_ids:
                verified.append((seq.matcher is not None, len(seq.draft_token_ids), seq.num_accepted_drafts))
        original(batch, block_manager, running)

    speculator.rollback = rollback


def _tokens(final) -> dict:
    return {rid: [list(c.token_ids) for c in out.outputs] for rid, out in final.items()}


GREEDY = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=9, temperature=0, min_tokens=3),                 # EOS may stop it
          SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[" 9", " c a", " two three"]),
          SamplingParams(max_tokens=11, temperature=0, ignore_eos=True, repetition_penalty=1.1,
                         frequency_penalty=-0.7)]


def test_greedy_identical_with_and_without_speculation(engine):
    # stops that fire inside accepted drafts: strings the outputs reach, and a token id (the digit 3)
    three = engine.tokenizer.encode("3", add_special_tokens=False)
    assert len(three) == 1
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=three), GREEDY[1],
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[" sat", "\nx", " four one"]),
              GREEDY[3]]
    base = _run(engine, PROMPTS, params, None)
    reasons = [c.stop_reason for out in base.values() for c in out.outputs]
    assert any(isinstance(r, str) for r in reasons) and three[0] in reasons, reasons
    spec = _run(engine, PROMPTS, params, 3)
    s = engine.speculator
    assert s.num_drafts > 0 and s.num_accepted_tokens > 0, (s.num_drafts, s.num_accepted_tokens)
    assert _tokens(spec) == _tokens(base)
    assert {r: [c.text for c in o.outputs] for r, o in spec.items()} == \
           {r: [c.text for c in o.outputs] for r, o in base.items()}
    assert {r: [c.finish_reason for c in o.outputs] for r, o in spec.items()} == \
           {r: [c.finish_reason for c in o.outputs] for r, o in base.items()}


def test_seeded_sample_identical_at_k2_k5_and_without(engine):
    params = [SamplingParams(max_tokens=14, temperature=0.8, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.6, top_p=0.9, seed=3, ignore_eos=True, n=2)]
    prompts = BASE[:4]
    runs = {}
    accepted = 0
    for k in (None, 2, 5):
        runs[k] = _tokens(_run(engine, prompts, params, k))
        accepted += getattr(engine.speculator, "num_accepted_tokens", 0)
    assert accepted > 0
    assert runs[2] == runs[None]
    assert runs[5] == runs[None]


def test_verify_rows_equal_one_row_decode(engine, monkeypatch):
    """Each sampled row, keyed by (request, completion, context): a speculative step's rows give bit for bit
    the logits a 1-row decode step computed for the same context, and, penalties applied per position, the
    same token; every row's view of its sequence is that context's (output tokens, their count)."""
    seen: dict[tuple, tuple] = {}
    spec_rows = []
    sampler = engine.runner.sampler
    original = sampler.sample_each

    def recording(logits, seqs):
        results, failures = original(logits, seqs)
        assert not failures
        for row, (s, r) in enumerate(zip(seqs, results, strict=True)):
            assert list(s.output_token_ids) == list(s.token_ids[s.num_prompt_tokens:])
            assert s.num_output_tokens == len(s.token_ids) - s.num_prompt_tokens
            key = (s.request.request_id, s.index, tuple(s.token_ids))
            entry = (logits[row].clone(), r.token_id)
            if isinstance(s, DraftPosition):
                spec_rows.append((key, entry))
            else:
                seen[key] = entry
        return results, failures

    monkeypatch.setattr(sampler, "sample_each", recording)
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, frequency_penalty=-1.5),
              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, presence_penalty=1.0,
                             frequency_penalty=0.8)]
    _run(engine, BASE, params, None)
    _run(engine, BASE, params, 4)
    compared = [(key, entry) for key, entry in spec_rows if key in seen]
    assert len(compared) >= 2 * len(BASE)     # every first row, and the accepted ones
    first = {}
    for key, _ in compared:
        first[key[:2]] = min(first.get(key[:2], len(key[2])), len(key[2]))
    assert sum(len(key[2]) > first[key[:2]] for key, _ in compared) >= len(BASE)    # rows past a draft
    for key, (logits, token) in compared:
        assert torch.equal(logits, seen[key][0]), key
        assert token == seen[key][1], key


def test_abort_mid_speculation_leaks_no_blocks(engine):
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.7, seed=5, ignore_eos=True)]
    aborted = []

    def abort(engine, steps):
        s = engine.speculator
        # once drafts were accepted: abort one request each step, the prefill-shared ones first
        if s.num_accepted_tokens and engine.requests and steps % 2 == 0:
            rid = sorted(engine.requests)[0]
            aborted.append(rid)
            engine.abort_request(rid)

    final = _run(engine, BASE, params, 4, abort)
    assert aborted and len(aborted) + len(final) >= len(BASE) - 1


def test_spec_decode_metrics(engine):
    """vLLM's spec_decode_* counters, from the engine's stats to the server's /metrics text."""
    from kernel_lab.server.metrics import PREFIX, ServerMetrics

    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)]
    final = _run(engine, BASE, params, 3)
    spec = engine.stats()["spec_decode"]
    per_pos = spec["num_accepted_tokens_per_pos"]
    assert spec["num_drafts"] > 0 and 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert sum(per_pos) == spec["num_accepted_tokens"] and len(per_pos) == 3
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))    # position i accepted only after i - 1
    # each sequence's first token comes from its prefill; every verify step emits its accepted drafts + 1
    generated = sum(len(c.token_ids) for out in final.values() for c in out.outputs)
    assert generated >= spec["num_accepted_tokens"] + spec["num_drafts"]
    metrics = ServerMetrics("m")
    metrics.on_step(engine.stats())
    text = metrics.render()
    assert f'{PREFIX}spec_decode_num_drafts_total{{model_name="m"}} {spec["num_drafts"]}' in text
    assert f'{PREFIX}spec_decode_num_draft_tokens_total{{model_name="m"}} {spec["num_draft_tokens"]}' in text
    assert f'{PREFIX}spec_decode_num_accepted_tokens_total{{model_name="m"}} {spec["num_accepted_tokens"]}' in text
    assert f'{PREFIX}spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="1"}} {per_pos[1]}' \
        in text
    engine.speculator = NoSpeculation()
    assert "spec_decode" not in engine.stats()
    metrics.on_step(engine.stats())
    assert "spec_decode" not in metrics.render()


@pytest.mark.parametrize("budget", [16, 8])
def test_identical_under_preemption_and_a_short_token_budget(engine, budget):
    """A small pool (sequences preempted mid-speculation, recomputed from their prompt) and a budget that
    cuts drafts short: still the tokens of decoding without speculation, and the pool whole at the end."""
    small = LLMEngine(None, dtype="float32", device="cpu", weights="float32", max_model_len=64, max_num_seqs=8,
                      num_kv_blocks=10, max_num_batched_tokens=budget, block_size=8, enable_prefix_caching=True)
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)] * 3 + \
             [SamplingParams(max_tokens=16, temperature=0.7, seed=9, ignore_eos=True)]
    prompts = BASE
    base = _run(small, prompts, params, None)
    before = small.scheduler.num_preemptions
    spec = _run(small, prompts, params, 4)
    assert small.scheduler.num_preemptions > before and small.speculator.num_accepted_tokens > 0
    assert _tokens(spec) == _tokens(base)


@pytest.mark.parametrize("acceptance,row_cost,expected", [
    (0.9, 0.3, 4), (0.675, 0.3, 3), (0.5, 0.3, 1), (0.23, 0.3, 0),   # the longest d with acceptance^d > cost
    (0.5, 0.2, 2), (0.99, 0.99, 0), (1.0, 0.5, 4), (0.0, 0.0, 0)])
def test_draft_length_rule(acceptance, row_cost, expected):
    assert draft_length(acceptance, row_cost, 4) == expected


def test_step_cost_fits_the_row_cost_and_keeps_it_when_rows_stop_varying():
    cost = StepCost()
    assert cost.row_cost(1) == DEFAULT_ROW_COST                  # no timings yet
    for _ in range(20):
        cost.add(1, 0.004)
    assert cost.fit is None                                       # rows never varied: nothing to fit
    for i in range(40):                                           # 4 ms a step + 1 ms a row
        rows = 1 + i % 5
        cost.add(rows, 0.003 + 0.001 * rows)
    a, b = cost.fit
    assert abs(a - 0.003) < 1e-9 and abs(b - 0.001) < 1e-9
    assert abs(cost.row_cost(1) - 0.25) < 1e-6 and abs(cost.row_cost(16) - 16 / 19) < 1e-6
    for _ in range(300):                                          # drafting off: the last fit stays
        cost.add(1, 0.004)
    assert cost.fit == pytest.approx((a, b))


def _state_seq(seq_id, params):
    tokens = [5, 6, 7] * 4
    return SimpleNamespace(seq_id=seq_id, params=params, matcher=None, token_ids=tokens, num_tokens=len(tokens),
                           num_computed_tokens=len(tokens) - 1, num_output_tokens=0, draft_token_ids=[])


def test_a_sequence_whose_drafts_fail_stops_drafting_then_probes(engine):
    """Drive the Speculator's state by hand on a sequence whose n-grams always match: it starts from the
    prior's acceptance; misses lower it until no draft pays, then it proposes nothing for PROBE_INTERVAL of
    its steps and probes with one; hits raise it again; a sequence no longer running is forgotten."""
    s = _speculator(engine, 4)
    s.step_cost.fit = (0.003, 0.001)          # a row costs 1/4 of a batch-1 step
    seq = _state_seq(7, SamplingParams(max_tokens=40, temperature=0))
    s.propose([seq])
    assert seq.draft_token_ids == [5, 6, 7]                       # prior 2/3: (2/3)^3 > 1/4 > (2/3)^4
    state = s.draft_len[seq.seq_id]
    while state.acceptance ** 1 > 0.25:
        state.update(3, 0)
    s.propose([seq])
    assert seq.draft_token_ids == [5] and state.wait == PROBE_INTERVAL    # the first probe
    for _ in range(PROBE_INTERVAL):
        s.propose([seq])
        assert seq.draft_token_ids == []
    s.propose([seq])
    assert seq.draft_token_ids == [5]                             # the next probe
    for _ in range(12):
        state.update(4, 4)
    s.propose([seq])
    assert seq.draft_token_ids == [5, 6, 7, 5]
    s.propose([])
    assert seq.seq_id not in s.draft_len


def test_verify_updates_the_acceptance_estimate(engine):
    """verify() counts a draft position as a trial up to the first rejected one, with decayed memory."""
    from kernel_lab.engine.sampler import SampleResult
    s = _speculator(engine, 4)
    seq = SimpleNamespace(seq_id=3, draft_token_ids=[5, 6, 7, 5], num_accepted_drafts=0)
    state = s.draft_len[3] = DraftState()

    def verify(tokens):
        rows = [SampleResult(DraftPosition(seq, i), t) for i, t in enumerate(tokens)]
        out, failed = s.verify(rows, [])
        assert not failed
        return [r.token_id for r in out]

    assert verify([5, 6, 9, 5, 1]) == [5, 6, 9]                  # 2 accepted, the third rejected: 3 trials
    assert (state.accepted, state.trials) == pytest.approx((2 * 0.9 + 2, 3 * 0.9 + 3))
    seq.draft_token_ids = [5, 6]
    assert verify([5, 6, 1]) == [5, 6, 1]                         # all accepted: 2 trials
    assert (state.accepted, state.trials) == pytest.approx((3.8 * 0.9 + 2, 5.7 * 0.9 + 2))


def test_seeded_rejection_sampled_drafts_ignore_the_step_timings(engine):
    """A seeded sampled sequence under a draft model's rejection rule takes its draft length from its
    acceptance and DEFAULT_ROW_COST only (its text depends on where it drafts); others follow the fit."""
    c = SpeculativeConfig.parse({"model": "bundled", "num_speculative_tokens": 4})
    s = Speculator(c, engine.config.max_model_len, SimpleNamespace(propose=lambda pending, running: None))
    s.step_cost.fit = (0.001, 0.01)           # rows so dear that nothing would draft by the fit
    seeded = _state_seq(1, SamplingParams(max_tokens=40, temperature=0.8, seed=3))
    greedy = _state_seq(2, SamplingParams(max_tokens=40, temperature=0))
    assert s.schedule_fixed(seeded) and not s.schedule_fixed(greedy)
    seen = []
    s.proposer.propose = lambda pending, running: seen.extend((q.seq_id, k) for q, k in pending)
    s.propose([seeded, greedy])
    assert seen == [(1, 3), (2, 1)]           # (2/3)^3 > 1/4; the greedy one: a probe
    assert not Speculator(SpeculativeConfig.parse({"model": "m", "num_speculative_tokens": 4,
                                                   "acceptance_method": "coupled"}),
                          64, s.proposer).schedule_fixed(seeded)


def test_no_drafts_in_a_step_with_more_running_than_disable_by_batch_size(engine):
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                 "disable_by_batch_size": 2})
    s = Speculator(c, engine.config.max_model_len)
    tokens = [5, 6, 7] * 4
    seqs = [SimpleNamespace(seq_id=i, params=SamplingParams(max_tokens=40, temperature=0), matcher=None,
                            token_ids=tokens, num_tokens=len(tokens), num_computed_tokens=len(tokens) - 1,
                            num_output_tokens=0, draft_token_ids=[]) for i in range(3)]
    s.propose(seqs)
    assert all(seq.draft_token_ids == [] for seq in seqs) and len(s.draft_len) == 3
    s.propose(seqs[:2])
    assert all(seq.draft_token_ids == [5, 6] for seq in seqs[:2])


JSON_SCHEMA = {"type": "object", "properties": {"count": {"type": "integer", "minimum": -999, "maximum": 999},
                                                "word": {"type": "string", "maxLength": 8}},
               "required": ["count", "word"], "additionalProperties": False}
# prompts the constrained outputs copy from, so prompt lookup proposes drafts the grammar allows
STRUCTURED_PROMPTS = ['Answer in JSON. {"count": 3, "word": "cat"} {"count": 4, "word": "dog"} {"count":',
                      "ab ab ab ab done. ab ab ab", "Pick one: red apple, green pear. I pick red apple. I pick",
                      '{"name": "add", "arguments": {"a": 2, "b": 0.5}} {"name": "add", "arguments": {"a":',
                      "The cat sat on the mat. The cat sat on the", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"]


def _structured_params():
    from kernel_lab.engine.structured_output import make_spec, parse_structured_output
    from kernel_lab.engine.tool_calls import tool_choice_spec

    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "b": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["a", "b"]}}}]
    json_spec = parse_structured_output({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": JSON_SCHEMA, "strict": True}}})
    return [SamplingParams(max_tokens=40, temperature=0, structured_outputs=json_spec),
            SamplingParams(max_tokens=30, temperature=0, structured_outputs=make_spec("regex", r"(ab ){2,5}done",
                                                                                       "regex")),
            SamplingParams(max_tokens=20, temperature=0, structured_outputs=make_spec(
                "choice", ["red apple", "green pear"], "guided_choice")),
            SamplingParams(max_tokens=60, temperature=0, structured_outputs=tool_choice_spec(tools, "required")),
            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=40, temperature=0.8, seed=7, structured_outputs=json_spec)]


def _check_structured(i: int, text: str) -> None:
    import json
    import re

    from kernel_lab.engine.tool_calls import ForcedToolParser

    if i in (0, 5):
        value = json.loads(text)
        assert set(value) == {"count", "word"} and isinstance(value["count"], int) \
            and -999 <= value["count"] <= 999, text
    elif i == 1:
        assert re.fullmatch(r"(ab ){2,5}done", text), text
    elif i == 2:
        assert text in ("red apple", "green pear"), text
    elif i == 3:
        _, calls = ForcedToolParser("required").parse(text)
        assert calls and all(c["function"]["name"] == "add" for c in calls), text
        for c in calls:
            args = json.loads(c["function"]["arguments"])
            assert isinstance(args["a"], int) and 0 <= args["b"] <= 1, text


def test_structured_outputs_and_tool_calls_speculate_and_stay_valid(engine):
    """JSON schema, regex, choice and forced tool-call requests (greedy, and a seeded JSON one) speculate
    beside a plain request: drafts are proposed and accepted for the constrained requests, every output
    matches its grammar, and the tokens equal those without speculation."""
    pytest.importorskip("xgrammar")
    params = _structured_params()
    prompts = STRUCTURED_PROMPTS
    base = _run(engine, prompts, params, None)
    seen = []
    spec = _run(engine, prompts, params, 4, verified=seen)
    constrained = [(d, a) for c, d, a in seen if c]
    assert constrained and sum(a for _, a in constrained) > 0, seen
    assert _tokens(spec) == _tokens(base)
    for rid, out in spec.items():
        _check_structured(int(rid[1:]) % len(params), out.outputs[0].text)


def test_walking_the_grammar_masks_each_row_cuts_forbidden_drafts_and_restores_the_matcher(engine):
    """walk_grammar on a real xgrammar matcher (choice "red apple" | "green pear"): row j's mask is the one
    a fresh matcher gives after the first j drafts; drafts stop at the first token the grammar forbids, and
    after a stop token that ends it; the matcher is left where it was."""
    pytest.importorskip("xgrammar")
    from kernel_lab.engine.grammar import GrammarCompileService, SequenceMatcher
    from kernel_lab.engine.speculative import walk_grammar
    from kernel_lab.engine.structured_output import make_spec

    tok = engine.tokenizer
    service = GrammarCompileService.for_tokenizer(tok, engine.config.vocab_size)
    try:
        compiled = service.compile(make_spec("choice", ["red apple", "green pear"], "guided_choice"))
        red, pear = tok.encode("red apple", add_special_tokens=False), tok.encode(" pear", add_special_tokens=False)
        eos = min(tok.eos_token_ids)

        def fresh_masks(tokens):
            m = SequenceMatcher(compiled)
            words = (m.vocab_size + 31) // 32
            rows = []
            for t in [None] + tokens:
                if t is not None:
                    assert m.accept_token(t)
                if m.is_terminated():
                    rows.append(None)
                    break
                row = torch.empty((1, words), dtype=torch.int32)
                m.fill_bitmask(row, 0)
                rows.append(row[0])
            return rows

        def frozen(ahead):
            out = []
            for a in ahead:
                if a.is_terminated():
                    out.append(None)
                    continue
                row = torch.full((1, a.bits.shape[1]), -7, dtype=torch.int32)
                a.fill_bitmask(row, 0)
                out.append(row[0])
            return out

        m = SequenceMatcher(compiled)
        kept, ahead = walk_grammar(m, red + pear + [5])               # " pear" after "red apple": forbidden
        assert kept == red and len(ahead) == len(red) + 1
        for got, want in zip(frozen(ahead), fresh_masks(red), strict=True):
            assert torch.equal(got, want)
        kept, ahead = walk_grammar(m, red + [eos] + pear)             # the stop token ends it: nothing after
        assert kept == red + [eos] and ahead[-1].is_terminated() and not ahead[-2].is_terminated()
        kept, ahead = walk_grammar(m, pear)                           # forbidden at once: no drafts
        assert kept == [] and len(ahead) == 1
        # the matcher was never moved: it still takes either choice from the start
        for choice in ("green pear", "red apple"):
            twin = m.fork()
            assert all(twin.accept_token(t) for t in tok.encode(choice, add_special_tokens=False))
            assert twin.accept_token(eos) and twin.is_terminated()
        assert not m.is_terminated() and not m.accept_token(pear[0])
    finally:
        service.close()


def test_logprobs_requests_speculate_with_the_logprobs_of_decoding_without(engine):
    """Sampled logprobs (the chosen token's, its rank, the top 3) per accepted token equal those of decoding
    without speculation, bit for bit (the verify rows give a 1-row decode's logits)."""
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=12, temperature=0.7, seed=5, ignore_eos=True, logprobs=0)]

    def logprobs(final):
        return {rid: [[{t: (lp.logprob, lp.rank) for t, lp in entry.items()} for entry in c.logprobs]
                      for c in out.outputs] for rid, out in final.items()}

    base = _run(engine, BASE, params, None)
    seen = []
    spec = _run(engine, BASE, params, 4, verified=seen)
    assert sum(a for _, _, a in seen) > 0
    assert _tokens(spec) == _tokens(base)
    assert logprobs(spec) == logprobs(base)
    for rid, out in spec.items():     # one entry per token: the top 3 (greedy: the chosen is among them)
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.token_ids)
        assert all(len(e) == (3 if int(rid[1:]) % 2 == 0 else 1) for e in c.logprobs), rid


# ------------------------------------------------------------------------------------------- draft model
@pytest.fixture(scope="module")
def draft_proposer(engine):
    """The bundled GGUF's Q4_1 blocks (weights auto: quantized) drafting for the float32 target."""
    from kernel_lab.engine.draft_proposer import DraftModelProposer
    from kernel_lab.models.gguf import default_model_path

    return DraftModelProposer(str(default_model_path()), "auto", engine.config)


def _draft(engine, proposer, k: int, method: str = "coupled") -> Speculator:
    c = SpeculativeConfig.parse({"model": "bundled", "num_speculative_tokens": k, "acceptance_method": method})
    proposer.rule = c.rule
    return Speculator(c, engine.config.max_model_len, proposer)


def test_draft_model_greedy_identical_for_32_concurrent_prompts(engine, draft_proposer):
    assert draft_proposer.config.weights == "quantized" and engine.config.weights == "float32"
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), GREEDY[1], GREEDY[2], GREEDY[3]]
    base = _run(engine, PROMPTS, params, None)
    seen = []
    spec = _run(engine, PROMPTS, params, _draft(engine, draft_proposer, 4), verified=seen)
    accepted = sum(a for _, _, a in seen)
    assert accepted > len(PROMPTS), seen       # the quantized copy agrees with its float32 target most often
    assert _tokens(spec) == _tokens(base)
    assert {r: [c.finish_reason for c in o.outputs] for r, o in spec.items()} == \
           {r: [c.finish_reason for c in o.outputs] for r, o in base.items()}


def test_draft_model_seeded_sample_identical_at_k2_k5_and_without(engine, draft_proposer):
    """The draft samples each position with the target's keys (the coupled rule): the output is the output
    without speculation, and the drafts are accepted often, not only where the distributions are one-hot."""
    params = [SamplingParams(max_tokens=14, temperature=0.8, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.6, top_p=0.9, seed=3, ignore_eos=True, n=2),
              SamplingParams(max_tokens=14, temperature=1.0, top_k=20, seed=5, ignore_eos=True,
                             repetition_penalty=1.2)]
    runs, rates = {None: _tokens(_run(engine, BASE[:6], params, None))}, {}
    for k in (2, 5):
        seen = []
        runs[k] = _tokens(_run(engine, BASE[:6], params, _draft(engine, draft_proposer, k), verified=seen))
        rates[k] = sum(a for _, _, a in seen) / sum(d for _, d, _ in seen)
    assert runs[2] == runs[None] and runs[5] == runs[None]
    assert min(rates.values()) > 0.5, rates


def test_draft_model_under_preemption_aborts_and_a_short_budget(draft_proposer):
    """A pool so small that sequences are preempted mid-speculation, a 16-token budget, aborts: the tokens of
    decoding without speculation, and both pools whole at the end."""
    from kernel_lab.engine.draft_proposer import DraftModelProposer
    from kernel_lab.models.gguf import default_model_path

    small = LLMEngine(None, dtype="float32", device="cpu", weights="float32", max_model_len=64, max_num_seqs=8,
                      num_kv_blocks=10, max_num_batched_tokens=16, block_size=8, enable_prefix_caching=True)
    proposer = DraftModelProposer(str(default_model_path()), "auto", small.config)
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)] * 3 + \
             [SamplingParams(max_tokens=16, temperature=0.7, seed=9, ignore_eos=True)]
    base = _run(small, BASE, params, None)
    before = small.scheduler.num_preemptions
    spec = _run(small, BASE, params, _draft(small, proposer, 4))
    assert small.scheduler.num_preemptions > before and small.speculator.num_accepted_tokens > 0
    assert _tokens(spec) == _tokens(base)
    aborted = []

    def abort(engine, steps):
        if engine.speculator.num_accepted_tokens and engine.requests and steps % 3 == 0:
            aborted.append(sorted(engine.requests)[0])
            engine.abort_request(aborted[-1])

    _run(small, BASE, params, _draft(small, proposer, 4), abort)
    assert aborted
    before = small.scheduler.num_preemptions      # rejection sampling: both pools whole at the end too
    _run(small, BASE, params, _draft(small, proposer, 4, "rejection_sampler"))
    assert small.scheduler.num_preemptions > before
    _run(small, BASE, params, _draft(small, proposer, 4, "rejection_sampler"), abort)
    assert len(aborted) > 1


def test_draft_model_speculates_structured_outputs(engine, draft_proposer):
    pytest.importorskip("xgrammar")
    params = _structured_params()
    base = _run(engine, STRUCTURED_PROMPTS, params, None)
    seen = []
    spec = _run(engine, STRUCTURED_PROMPTS, params, _draft(engine, draft_proposer, 4), verified=seen)
    assert sum(a for c, _, a in seen if c) > 0, seen
    assert _tokens(spec) == _tokens(base)
    for rid, out in spec.items():
        _check_structured(int(rid[1:]) % len(params), out.outputs[0].text)


def test_a_draft_with_another_vocabulary_is_refused_by_name(engine):
    from kernel_lab.engine.draft_proposer import DraftModelProposer
    from kernel_lab.models.gguf import default_model_path

    c = engine.config
    target = SimpleNamespace(dtype=c.dtype, device=c.device, max_model_len=c.max_model_len, max_num_seqs=4,
                             max_num_batched_tokens=c.max_num_batched_tokens, block_size=c.block_size,
                             num_kv_blocks=c.num_kv_blocks, seed=0, vocab_size=c.vocab_size + 7)
    with pytest.raises(ValueError, match="speculative_config.model: the draft's vocabulary has 49152 tokens"):
        DraftModelProposer(str(default_model_path()), "auto", target)


# ------------------------------------------------------------------------------------ the rejection rule
SAMPLED = [SamplingParams(max_tokens=14, temperature=0.8, seed=11, ignore_eos=True),
           SamplingParams(max_tokens=14, temperature=0.6, top_p=0.9, seed=3, ignore_eos=True, n=2, logprobs=2),
           SamplingParams(max_tokens=14, temperature=1.0, top_k=20, min_p=0.05, seed=5, ignore_eos=True,
                          repetition_penalty=1.2)]


def test_draft_model_rejection_is_reproducible_in_any_batch_and_accepts_more_than_coupled(engine, draft_proposer):
    """Under vLLM's rejection_sampler, a seeded request's text is the same in a batch of six, reversed among
    filler requests, and twice; its acceptance is at least the coupled rule's (whose CPU draws couple badly:
    README, "Acceptance"); logprobs are the target's at the emitted tokens."""
    prompts = BASE[:6]
    seen, coupled_seen = [], []
    first = _tokens(_run(engine, prompts, SAMPLED, _draft(engine, draft_proposer, 4, "rejection_sampler"),
                         verified=seen))
    _run(engine, prompts, SAMPLED, _draft(engine, draft_proposer, 4, "coupled"), verified=coupled_seen)
    filler = [f"filler {i}: " + p for i, p in enumerate(BASE)]
    mixed_prompts = filler[:3] + prompts[::-1] + filler[3:]
    mixed_params = [SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)] * 3 + \
        [SAMPLED[(len(prompts) - 1 - i) % len(SAMPLED)] for i in range(len(prompts))] + \
        [SamplingParams(max_tokens=6, temperature=0)] * 5
    mixed = _run(engine, mixed_prompts, mixed_params, _draft(engine, draft_proposer, 4, "rejection_sampler"))
    again = {f"r{i}": mixed[f"r{3 + len(prompts) - 1 - i}"] for i in range(len(prompts))}
    assert _tokens(again) == first
    rate = sum(a for _, _, a in seen) / sum(d for _, d, _ in seen)
    coupled = sum(a for _, _, a in coupled_seen) / sum(d for _, d, _ in coupled_seen)
    assert rate > 0.6 and rate >= coupled, (rate, coupled)
    reference = _run(engine, [prompts[1]], [SamplingParams(max_tokens=1, temperature=0, logprobs=2)], None)
    for completion in again["r1"].outputs:          # logprobs=2: entries are the raw model's at emitted tokens
        assert len(completion.logprobs) == len(completion.token_ids)
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            assert token in entry
    # the first token comes from the prompt's last row (float32 GEMMs: bits depend on the batch's rows)
    want, got = reference["r0"].outputs[0].logprobs[0], again["r1"].outputs[0].logprobs[0]
    assert want.keys() == got.keys()
    assert all(abs(want[t].logprob - got[t].logprob) < 1e-4 and want[t].rank == got[t].rank for t in want)


def _position_one_pvalue(engine, proposer, prompt_ids: list[int], sequences: int, grammar=None,
                         allowed: range | None = None) -> tuple[float, float]:
    """(chi-square p-value, acceptance) of output token 1 (the first speculated position) under rejection,
    grouped by token 0, against the target's top-3 distribution there (over `allowed` tokens only, for a
    grammar that allows just those). The draft's logits are pushed far from the target's (+2 on even token
    ids), so q differs from p and the residual matters."""
    params = SamplingParams(max_tokens=3 if grammar is None else 5, temperature=1.0, top_k=3, n=20,
                            ignore_eos=grammar is None, structured_outputs=grammar)
    per_request = params.n
    seen = []
    process = proposer.runner.sampler.process

    def skewed(logits, seqs, temperature):
        out = process(logits, seqs, temperature).clone()
        out[:, 0::2] += 2.0
        return out

    proposer.runner.sampler.process = skewed
    try:
        runs = [_run(engine, [prompt_ids], [replace(params, seed=1000 + i)],
                     _draft(engine, proposer, 2, "rejection_sampler"), verified=seen)
                for i in range(sequences // per_request)]
    finally:
        proposer.runner.sampler.process = process
    by_first: dict[int, list[int]] = {}
    for final in runs:
        for c in final["r0"].outputs:
            by_first.setdefault(c.token_ids[0], []).append(c.token_ids[1])
    stat_p = []
    for t0, seconds in by_first.items():
        if len(seconds) < 30:
            continue
        ref = _run(engine, [prompt_ids + [t0]], [SamplingParams(max_tokens=1, temperature=0, logprobs=20)], None)
        top = ref["r0"].outputs[0].logprobs[0]
        ids = [t for t in sorted(top, key=lambda t: top[t].rank) if allowed is None or t in allowed][:3]
        assert len(ids) == 3, top           # then no allowed token outside the top 20 outranks them
        probs = torch.zeros(engine.config.vocab_size, dtype=torch.float64)
        probs[ids] = torch.softmax(torch.tensor([top[t].logprob for t in ids], dtype=torch.float64), 0)
        stat_p.append(chi_square_pvalue(torch.tensor(seconds), probs))
    assert stat_p, by_first
    rate = sum(a for _, _, a in seen) / sum(d for _, d, _ in seen)
    return min(stat_p) * len(stat_p), rate       # Bonferroni over the groups


def test_draft_model_rejection_is_distributed_as_the_target_and_the_check_has_teeth(engine, draft_proposer,
                                                                                     monkeypatch):
    import kernel_lab.ops.speculative as spec_ops

    prompt = engine.tokenizer.encode("The weather today is", add_special_tokens=False)
    pvalue, rate = _position_one_pvalue(engine, draft_proposer, prompt, 400)
    assert pvalue > ALPHA and 0.05 < rate < 0.95, (pvalue, rate)
    monkeypatch.setattr(spec_ops, "_residual", lambda p, q: p)      # the seeded bug: the residual is p
    pvalue_bug, _ = _position_one_pvalue(engine, draft_proposer, prompt, 400)
    assert pvalue_bug < ALPHA, pvalue_bug


def test_draft_model_rejection_speculates_structured_outputs(engine, draft_proposer):
    """Seeded sampling under rejection: the grammar's rows mask p, the draft (unconstrained) proposes
    forbidden tokens too, which stay as the last draft and are rejected; every output stays valid."""
    pytest.importorskip("xgrammar")
    params = [replace(p, temperature=0.7, seed=21 + i) for i, p in enumerate(_structured_params())]
    seen = []
    spec = _run(engine, STRUCTURED_PROMPTS, params, _draft(engine, draft_proposer, 4, "rejection_sampler"),
                verified=seen)
    assert sum(a for c, _, a in seen if c) > 0, seen
    for rid, out in spec.items():
        _check_structured(int(rid[1:]) % len(params), out.outputs[0].text)


def test_draft_model_rejection_under_a_grammar_is_distributed_as_the_target(engine, draft_proposer):
    """A four-digit regex: the unconstrained (and skewed) draft often proposes tokens the grammar forbids.
    Such a draft stays as the last one verified and is rejected with a residual draw; the first speculated
    digit is distributed as the target's masked top-3 there: p-value 0.28. Cutting the drafts before a
    forbidden one instead, so that the position draws from p, gives 7e-10 (seeded by hand)."""
    pytest.importorskip("xgrammar")
    from kernel_lab.engine.structured_output import make_spec

    digits = range(32, 42)
    assert [engine.tokenizer.encode(str(d), add_special_tokens=False) for d in range(10)] == [[t] for t in digits]
    prompt = engine.tokenizer.encode("The door code is", add_special_tokens=False)
    pvalue, rate = _position_one_pvalue(engine, draft_proposer, prompt, 600,
                                        make_spec("regex", "[0-9]{4}", "regex"), digits)
    assert pvalue > ALPHA and rate > 0, (pvalue, rate)
