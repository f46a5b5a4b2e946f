"""Scheduler property test (hypothesis): random adds, steps, finishes and aborts on a tiny KV pool, checked
after every operation by test_scheduler.py's shadow-cache simulator (`Sim`). Its own module so that the
unit tests still run where hypothesis is not installed (the bare GPU box)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

_spec = importlib.util.spec_from_file_location("scheduler_unit_tests", Path(__file__).with_name("test_scheduler.py"))
_units = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_units)
Sim, PROMPT_HEADS = _units.Sim, _units.PROMPT_HEADS


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.sim = None

    @rule(blocks=st.integers(6, 14), caching=st.booleans(), max_seqs=st.integers(1, 4),
          budget=st.integers(4, 12))
    @precondition(lambda self: self.sim is None)
    def create(self, blocks, caching, max_seqs, budget):
        # A sequence may reach 6 + 4 + 8 = 18 tokens = 5 blocks, so any pool here fits one sequence.
        self.sim = Sim(num_blocks=blocks, block_size=4, max_num_seqs=max_seqs, max_tokens_per_step=budget,
                       caching=caching)

    @rule(head=st.sampled_from(PROMPT_HEADS), tail=st.lists(st.integers(0, 3), max_size=6),
          max_tokens=st.integers(1, 4))
    @precondition(lambda self: self.sim is not None and len(self.sim.live) < 8)
    def add(self, head, tail, max_tokens):
        self.sim.add(list(head) + tail, max_tokens)

    @rule(token=st.integers(0, 3))
    @precondition(lambda self: self.sim is not None and self.sim.sched.has_unfinished())
    def step(self, token):
        self.sim.step(lambda seq: token)

    @rule(data=st.data())
    @precondition(lambda self: self.sim is not None and bool(self.sim.live))
    def abort(self, data):
        seq = data.draw(st.sampled_from(self.sim.live))
        self.sim.finish(seq)

    @invariant()
    def consistent(self):
        if self.sim is not None:
            self.sim.check()

    def teardown(self):
        if self.sim is not None:
            self.sim.drain()
            self.sim.check()
            assert self.sim.bm.num_free_blocks == self.sim.bm.num_blocks, "blocks leaked"


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestSchedulerProperties = SchedulerMachine.TestCase
