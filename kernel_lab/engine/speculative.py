"""Speculative decoding in the engine (n-gram or draft-model drafts, projects/10_speculative/README.md, "In the
engine").

A step, for a decoding sequence with drafts d1..dk (`Sequence.draft_token_ids`, set by `propose` before
scheduling):
- the scheduler gives it 1 + k tokens of the step's budget (fewer drafts when the budget is short), and the
  runner computes its last token and the drafts in one pass, sampling all k + 1 rows;
- row j is sampled as `DraftPosition` j: the sequence as it would be with d1..dj appended, so the keyed
  seed (Sampler.step_seed: request seed, completion index, position), penalties, logit_bias and min_tokens
  are exactly what decoding without speculation has at that position;
- `verify` accepts drafts while they equal those draws and emits the accepted drafts and one draw, one
  SampleResult per token, so every stop rule holds per token (the output processor stops at the first);
- `rollback`: only the last token and the accepted drafts count as computed, the blocks past the new
  length are freed, and the prefix cache only ever registers blocks of computed, accepted tokens.
For a deterministic proposer this is both of ops.rejection_sample's rules (one-hot q): the output is token
for token the output without speculation, greedy or seeded. A draft model under `rejection`
(speculative_config.acceptance_method "rejection_sampler") draws its drafts from its own q with keys of its
own (`ProposalPosition`), keeps q's logits (`Sequence.draft_logits`), and the sampler verifies the sequence's
rows with ops.rejection_sample: the output is distributed as the target's, with the maximal acceptance rate.

Structured outputs: `propose` walks the drafts through the sequence's grammar matcher, records the mask the
grammar gives ahead of each row (`GrammarAhead`), cuts the drafts at the first token the grammar forbids
(its row could never sample it) or after one that ends the grammar, and rolls the matcher back. Under
`rejection` a forbidden draft stays, the last one verified: its rejection is certain (p = 0 there), and the
row must then emit from max(0, p - q), not from p, or the output would not be distributed as p. Row j is then
masked exactly as decoding without speculation masks that position; the output processor advances the real
matcher by the accepted tokens only. Logprobs are per row, as without speculation. Not speculated: sequences
still in prefill.
"""

from __future__ import annotations

import time
from collections import defaultdict

from .ngram_proposer import propose_ngram
from .sampler import SampleResult
from .speculative_config import SpeculativeConfig


class DraftPosition:
    """What the sampler reads of a sequence, `offset` drafts ahead of its real state."""

    __slots__ = ("seq", "offset")

    def __init__(self, seq, offset: int):
        self.seq, self.offset = seq, offset

    @property
    def params(self):
        return self.seq.params

    @property
    def request(self):
        return self.seq.request

    @property
    def index(self) -> int:
        return self.seq.index

    @property
    def draft_logits(self):
        """The draft's logits for this row's verify group (None: verified by equality)."""
        return self.seq.draft_logits

    @property
    def matcher(self):
        masks = self.seq.draft_masks
        return masks[self.offset] if masks else None

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.seq.draft_token_ids[:self.offset]

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.seq.draft_token_ids[:self.offset]

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + self.offset


class ProposalPosition(DraftPosition):
    """A draft model's row under `rejection`: the position's parameters, but keys of its own (independent of
    the target's acceptance and residual draws), and its processed logits kept (q)."""

    __slots__ = ()
    key_salt = ("draft",)
    keep_distribution = True
    draft_logits = None


def draft_positions(seq) -> list[DraftPosition]:
    return [DraftPosition(seq, j) for j in range(len(seq.draft_token_ids) + 1)]


class GrammarAhead:
    """The grammar's state at one draft row, frozen at proposal time: what the sampler reads of a matcher
    (fill_bitmask, is_terminated, vocab_size), from a mask row filled while the drafts were walked."""

    __slots__ = ("bits", "row", "terminated", "vocab_size")

    def __init__(self, bits, row: int, terminated: bool, vocab_size: int):
        self.bits, self.row, self.terminated, self.vocab_size = bits, row, terminated, vocab_size

    def is_terminated(self) -> bool:
        return self.terminated

    def fill_bitmask(self, bitmask, row: int = 0) -> None:
        bitmask[row].copy_(self.bits[self.row])


def walk_grammar(matcher, drafts: list[int]) -> tuple[list[int], list[GrammarAhead]]:
    """(drafts the grammar allows, one GrammarAhead per row): rows 0..len(kept), the matcher as it stands
    after the kept drafts before each; the matcher is left as it was."""
    import torch

    words = (matcher.vocab_size + 31) // 32
    bits = torch.empty((len(drafts) + 1, words), dtype=torch.int32)
    ahead, taken = [], 0
    try:
        for j in range(len(drafts) + 1):
            terminated = matcher.is_terminated()
            if not terminated:
                matcher.fill_bitmask(bits, j)
            ahead.append(GrammarAhead(bits, j, terminated, matcher.vocab_size))
            if terminated or j == len(drafts) or not matcher.accept_token(drafts[j]):
                break
            taken += 1
    finally:
        matcher.rollback(taken)
    return drafts[:len(ahead) - 1], ahead


class NoSpeculation:
    """The engine's speculator without --speculative-config: every hook passes the step through."""

    def propose(self, running) -> None:
        pass

    def verify(self, results, failures):
        return results, failures

    def rollback(self, batch, block_manager, running) -> None:
        pass

    def stats_fields(self) -> dict:
        return {}


def acceptance_summary(counters: dict) -> dict:
    """Speculator.counters() -> the figures vLLM's logs give: the draft acceptance rate, the mean tokens a
    verify emits (accepted drafts + 1) and the acceptance rate per draft position."""
    drafts, proposed = counters["num_drafts"], counters["num_draft_tokens"]
    return {"acceptance_rate": counters["num_accepted_tokens"] / proposed if proposed else None,
            "mean_acceptance_length": 1 + counters["num_accepted_tokens"] / drafts if drafts else None,
            "acceptance_per_position": [n / drafts if drafts else None
                                        for n in counters["num_accepted_tokens_per_pos"]]}


class NgramProposer:
    """Prompt lookup over each sequence's own tokens (ngram_proposer.py)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, pending, running) -> None:
        c = self.config
        for seq, k in pending:
            seq.draft_token_ids = propose_ngram(seq.token_ids, c.prompt_lookup_min, c.prompt_lookup_max, k)


def make_speculator(engine_config):
    """The engine's speculator for its EngineConfig (after the target's runner sized the KV pool)."""
    config = engine_config.speculative_config
    if config is None:
        return NoSpeculation()
    if config.model is None:
        proposer = NgramProposer(config)
    else:
        from .draft_proposer import DraftModelProposer
        proposer = DraftModelProposer(config.model, config.weights, engine_config, config.rule)
    return Speculator(config, engine_config.max_model_len, proposer)


# A sequence whose drafts are not worth verifying proposes none for this many of its steps, then probes with
# one; each probe rejected in a row doubles the wait, up to 8 times this.
PROBE_INTERVAL = 8
MAX_PROBE_BACKOFF = 3
ACCEPTANCE_PRIOR = (2.0, 3.0)   # (accepted, trials) before a sequence's first verify: acceptance 2/3
ACCEPTANCE_MEMORY = 0.9         # each verify's weight in the estimate decays by this per later verify
# A draft row's cost in tokens of throughput until the step timings have fitted one (StepCost), and always for
# sequences whose text depends on their draft schedule (seeded sampling verified by rejection sampling).
DEFAULT_ROW_COST = 0.25


def draft_length(acceptance: float, row_cost: float, k_max: int) -> int:
    """The number of drafts worth verifying: draft d is emitted only if the d - 1 before it were accepted,
    probability acceptance^d (taking positions alike), and it costs one more row, worth `row_cost` tokens of
    the step's output; so the longest d <= k_max with acceptance^d > row_cost."""
    d, emitted = 0, acceptance
    while d < k_max and emitted > row_cost:
        d += 1
        emitted *= acceptance
    return d


class StepCost:
    """Least squares of a decode-only step's wall time on its rows, exponentially forgotten (weight 0.98 per
    later step): seconds = a + b * rows. `row_cost(n)` is one more row's cost in tokens of a step of n
    decoding sequences, b * n / (a + b * n): at batch 1 the marginal row over the step, and toward 1 as a large
    batch's rows dominate the step (where a draft must almost surely be accepted to pay). The fit holds while
    the rows vary; when they stop (drafting off), the last fit stays."""

    def __init__(self, memory: float = 0.98):
        self.memory = memory
        self.sums = [0.0] * 5           # weights, rows, rows^2, seconds, rows * seconds
        self.fit: tuple[float, float] | None = None

    def add(self, rows: int, seconds: float) -> None:
        for i, v in enumerate((1.0, rows, rows * rows, seconds, rows * seconds)):
            self.sums[i] = self.sums[i] * self.memory + v
        w, r, rr, t, rt = self.sums
        spread = rr / w - (r / w) ** 2
        if w >= 8 and spread >= 0.25:
            b = (rt / w - r / w * t / w) / spread
            a = t / w - b * r / w
            if b > 0 and a > 0:
                self.fit = (a, b)

    def row_cost(self, rows: int) -> float:
        if self.fit is None:
            return DEFAULT_ROW_COST
        a, b = self.fit
        return b * rows / (a + b * rows)


class DraftState:
    """A running sequence's acceptance estimate (decayed counts of accepted drafts and of trials: drafts up
    to and including the first rejected one) and the steps it waits before probing again."""

    __slots__ = ("accepted", "trials", "wait", "failed_probes")

    def __init__(self):
        self.accepted, self.trials = ACCEPTANCE_PRIOR
        self.wait = self.failed_probes = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.trials

    def probe(self) -> int:
        """Start a one-draft probe; the wait before the next doubles with each rejected probe in a row."""
        self.wait = PROBE_INTERVAL << min(self.failed_probes, MAX_PROBE_BACKOFF)
        return 1

    def update(self, drafted: int, accepted: int) -> None:
        if self.wait:       # a verify while waiting is the probe's
            self.failed_probes = self.failed_probes + 1 if accepted == 0 else 0
        self.accepted = self.accepted * ACCEPTANCE_MEMORY + accepted
        self.trials = self.trials * ACCEPTANCE_MEMORY + accepted + (accepted < drafted)


class Speculator:
    """The engine's hooks, and vLLM's spec_decode counters (num_drafts, num_draft_tokens,
    num_accepted_tokens, num_accepted_tokens_per_pos)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer=None):
        self.config = config
        self.proposer = proposer or NgramProposer(config)
        self.max_model_len = max_model_len
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * config.num_speculative_tokens
        self.draft_len: dict[int, DraftState] = {}     # only running sequences
        self.step_cost = StepCost()
        self._step_started = 0.0

    def stats_fields(self) -> dict:
        return {"spec_decode": self.counters()}

    def counters(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos)}

    def eligible(self, seq) -> bool:
        return seq.params.max_tokens != 0 and seq.num_tokens - seq.num_computed_tokens == 1

    def schedule_fixed(self, seq) -> bool:
        """Whether the sequence's text depends on where it drafts: seeded sampling verified by rejection
        sampling (each verified position draws differently from a plain one). Its draft lengths then follow
        its acceptance alone, never the step timings, so that it reproduces."""
        return (self.config.model is not None and self.config.rule == "rejection" and not seq.params.greedy
                and seq.params.seed is not None)

    def propose(self, running) -> None:
        """Draft lengths (draft_length, from each sequence's acceptance and the step's measured row cost, or a
        probe of one draft every PROBE_INTERVAL steps where that is 0), then the proposer's drafts."""
        c = self.config
        self._step_started = time.perf_counter()
        live, pending = {}, []
        off = c.disable_by_batch_size is not None and len(running) > c.disable_by_batch_size
        row_cost = self.step_cost.row_cost(len(running))
        for seq in running:
            seq.draft_token_ids, seq.draft_masks, seq.draft_logits = [], [], None
            state = live[seq.seq_id] = self.draft_len.get(seq.seq_id) or DraftState()
            if off or not self.eligible(seq):
                continue
            k = draft_length(state.acceptance, DEFAULT_ROW_COST if self.schedule_fixed(seq) else row_cost,
                             c.num_speculative_tokens)
            if k == 0:
                if state.wait > 0:
                    state.wait -= 1
                    continue
                k = state.probe()
            else:
                state.wait = 0
            # no draft past max_tokens (each step emits drafts + 1) or past the model's length
            if seq.params.max_tokens is not None:
                k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
            k = min(k, self.max_model_len - seq.num_tokens)
            if k > 0:
                pending.append((seq, k))
        self.draft_len = live   # finished and preempted sequences drop out here
        self.proposer.propose(pending, running)
        for seq, _ in pending:
            drafts = seq.draft_token_ids
            if drafts and seq.matcher is not None:
                kept, ahead = walk_grammar(seq.matcher, drafts)
                if seq.draft_logits is not None and len(kept) < len(drafts) and not ahead[-1].terminated:
                    kept = drafts[:len(kept) + 1]       # the forbidden draft, rejected for certain
                    ahead.append(ahead[-1])             # its next row is never emitted
                seq.draft_token_ids = kept
                seq.draft_masks = ahead if kept else []
            if seq.draft_logits is not None:
                seq.draft_logits = seq.draft_logits[:len(seq.draft_token_ids)] if seq.draft_token_ids else None

    def verify(self, results: list[SampleResult], failures):
        """The sampler's per-row results (DraftPosition rows included) -> per-sequence tokens to append."""
        rows = defaultdict(list)
        out, failed, failed_seqs = [], [], set()
        for row, exc in failures:
            seq = row.seq if isinstance(row, DraftPosition) else row
            if seq.seq_id not in failed_seqs:
                failed_seqs.add(seq.seq_id)
                failed.append((seq, exc))
        for r in results:
            if isinstance(r.seq, DraftPosition):
                rows[r.seq.seq.seq_id].append(r)
            elif r.seq.seq_id not in failed_seqs:
                out.append(r)
        for group in rows.values():
            seq = group[0].seq.seq
            if seq.seq_id in failed_seqs:
                continue
            group.sort(key=lambda r: r.seq.offset)
            drafts = seq.draft_token_ids
            accepted = 0
            # a group verified by rejection sampling holds only its emitted tokens (accepted drafts + 1)
            while accepted < len(drafts) and accepted + 1 < len(group) and drafts[accepted] == group[accepted].token_id:
                accepted += 1
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += accepted
            for pos in range(accepted):
                self.num_accepted_tokens_per_pos[pos] += 1
            for r in group[:accepted + 1]:
                out.append(SampleResult(seq, r.token_id, r.logprob, r.top_logprobs, r.rank))
            seq.num_accepted_drafts = accepted
            state = self.draft_len.get(seq.seq_id)
            if state is not None:
                state.update(len(drafts), accepted)
        return out, failed

    def rollback(self, batch, block_manager, running) -> None:
        """After the output processor appended the tokens: the accepted drafts' K/V count as computed; the
        rejected ones' slots are given back with every block past the sequence's new length. Drafts of
        running sequences the budget left out of the step are dropped too: no draft outlives its step. A
        decode-only step's rows and wall time (since `propose`) feed the row-cost fit."""
        if batch.items and all(n == 1 + len(seq.draft_token_ids) for seq, n in batch.items):
            self.step_cost.add(sum(n for _, n in batch.items), time.perf_counter() - self._step_started)
        for seq, _ in batch.items:
            drafts = seq.draft_token_ids
            if not drafts:
                continue
            accepted = getattr(seq, "num_accepted_drafts", 0)
            seq.draft_token_ids, seq.draft_masks, seq.draft_logits, seq.num_accepted_drafts = [], [], None, 0
            if seq.is_finished or not seq.block_table:
                continue
            # the output processor appended accepted + 1 tokens, or fewer where a stop rule ended it
            seq.num_computed_tokens = min(seq.num_computed_tokens + accepted, seq.num_tokens - 1)
            block_manager.truncate(seq, seq.num_tokens)
        for seq in running:
            seq.draft_token_ids, seq.draft_masks, seq.draft_logits = [], [], None
