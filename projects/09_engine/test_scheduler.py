"""Block manager and scheduler, without a model: unit tests, and the shadow-cache simulator that
test_scheduler_properties.py drives with hypothesis.

The property test drives a scheduler with a tiny KV pool through random adds, steps, finishes and aborts,
and simulates the model with a shadow cache: every computed token writes, into its slot, the whole token
prefix it depends on. After every operation it checks that no block leaks, that reference counts equal
the number of block tables holding each block, that a block being written is owned by exactly one
sequence and is not in the prefix cache, and that every running sequence still finds its own K/V in
every computed slot (nobody overwrote it), as does every block registered in the prefix cache.
"""

from __future__ import annotations

import pytest

from kernel_lab.engine.block_manager import BlockManager
from kernel_lab.engine.sampling_params import SamplingParams
from kernel_lab.engine.scheduler import Scheduler
from kernel_lab.engine.sequence import Request, SequenceStatus


class Sim:
    """A scheduler plus a fake model that records, per cache slot, the token prefix its K/V encodes."""

    def __init__(self, num_blocks=12, block_size=4, max_num_seqs=4, max_tokens_per_step=10, caching=True):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.sched = Scheduler(self.bm, max_num_seqs, max_tokens_per_step)
        self.shadow: dict[int, tuple[int, ...]] = {}
        self.arrivals = 0
        self.live: list = []
        self.finished: list = []

    def add(self, prompt, max_tokens):
        req = Request(f"r{self.arrivals}", None, prompt, SamplingParams(max_tokens=max_tokens), self.arrivals)
        self.arrivals += 1
        for seq in req.seqs:
            self.sched.add(seq)
            self.live.append(seq)
        return req

    def slot(self, seq, pos):
        bs = self.bm.block_size
        return seq.block_table[pos // bs] * bs + pos % bs

    def step(self, next_token=lambda seq: 7):
        batch = self.sched.schedule()
        if self.sched.has_unfinished():
            assert batch, "scheduler made no progress with unfinished sequences"
        self.bm.drain_fresh_blocks()
        for seq, n in batch.items:
            assert seq.status == SequenceStatus.RUNNING
            assert 1 <= n <= seq.num_tokens - seq.num_computed_tokens
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block = self.bm.blocks[seq.block_table[pos // self.bm.block_size]]
                assert block.ref_count == 1, f"writing into shared block {block}"
                assert block.hash is None, f"writing into a prefix-cached block {block}"
                self.shadow[self.slot(seq, pos)] = tuple(seq.token_ids[:pos + 1])
        assert batch.num_tokens <= self.sched.max_num_batched_tokens
        for seq in self.sched.update_computed(batch):
            seq.token_ids.append(next_token(seq))
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.finish(seq)
        return batch

    def finish(self, seq):
        self.sched.finish(seq)
        self.live.remove(seq)
        self.finished.append(seq)

    def drain(self, limit=10_000):
        for _ in range(limit):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("did not finish")

    def check(self):
        bm = self.bm
        holders = {}
        for seq in self.live:
            if seq.status == SequenceStatus.WAITING:
                assert not seq.block_table and seq.num_computed_tokens == 0, "a waiting sequence holds blocks"
            for b in seq.block_table:
                holders[b] = holders.get(b, 0) + 1
            assert len(seq.block_table) >= bm.blocks_for(seq.num_computed_tokens)
        for seq in self.finished:
            assert not seq.block_table
        for block in bm.blocks:
            assert block.ref_count == holders.get(block.block_id, 0), f"ref count of {block}"
            assert (block.ref_count == 0) == (block.block_id in bm.free_list), f"free list vs {block}"
        assert len(bm.free_list) == sum(1 for b in bm.blocks if b.ref_count == 0)
        for h, block_id in bm.cached.items():
            block = bm.blocks[block_id]
            assert block.hash == h
            # A registered block still holds exactly the K/V of its tokens.
            bs = bm.block_size
            for offset in range(bs):
                stored = self.shadow.get(block_id * bs + offset)
                assert stored is not None and (len(stored) - 1) % bs == offset
                assert stored[-(offset + 1):] == block.token_ids[:offset + 1]
        for block in bm.blocks:
            if block.hash is not None:
                assert bm.cached.get(block.hash) == block.block_id
        for seq in self.live:  # nobody's computed K/V was overwritten
            for pos in range(seq.num_computed_tokens):
                assert self.shadow.get(self.slot(seq, pos)) == tuple(seq.token_ids[:pos + 1]), \
                    f"K/V of {seq} at position {pos} was overwritten"


# ------------------------------------------------------------------------------------------------ units
def test_prefix_cache_hit_shares_full_blocks_and_counts_refs():
    sim = Sim(num_blocks=16, block_size=4, max_num_seqs=4, max_tokens_per_step=64)
    prompt = list(range(100, 113))                       # 3 full blocks + 1 token
    a = sim.add(prompt, 10).seqs[0]
    sim.step()
    sim.check()
    b = sim.add(prompt + [5, 6], 2).seqs[0]
    sim.step()
    sim.check()
    assert b.num_cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    assert all(sim.bm.blocks[x].ref_count == 2 for x in a.block_table[:3])
    assert sim.bm.prefix_cache_hits == 12
    sim.drain()
    sim.check()
    assert sim.bm.num_free_blocks == 16


def test_fully_cached_prompt_still_computes_its_last_block():
    sim = Sim(num_blocks=16, block_size=4, max_tokens_per_step=64)
    prompt = list(range(200, 208))                       # exactly 2 blocks
    sim.add(prompt, 1)
    sim.drain()
    b = sim.add(prompt, 1).seqs[0]
    batch = sim.step()
    assert b.num_cached_tokens == 4                      # the last block is recomputed for the logits
    assert batch.items == [(b, 4)] or b.is_finished
    sim.check()


def _computed_seq(bm, tokens, arrival):
    """A sequence admitted through the block manager with all its tokens computed and committed."""
    seq = Request(f"r{arrival}", None, tokens, SamplingParams(), arrival).seqs[0]
    assert bm.allocate(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.commit(seq)
    return seq


def test_lru_evicts_the_oldest_freed_cached_block_first_and_revives_on_hit():
    bm = BlockManager(8, 4)
    first = _computed_seq(bm, list(range(300, 309)), 0)          # blocks A B (full, cached) + C (partial)
    a, b, c = first.block_table
    assert len(bm.cached) == 2
    bm.free(first)                                               # free order C, B, A: A is evicted last
    assert list(bm.free_list)[-3:] == [c, b, a]
    other = _computed_seq(bm, list(range(500, 520)), 1)          # 5 never-used blocks: the cache survives
    assert not {a, b, c} & set(other.block_table) and len(bm.cached) == 2 + 5
    second = _computed_seq(bm, list(range(600, 606)), 2)         # 2 more blocks: C, then B (evicted)
    assert second.block_table == [c, b]
    bm.free(other)
    bm.free(second)
    assert list(bm.free_list)[0] == a                            # A is now the least recently freed
    revived = Request("r3", None, list(range(300, 309)), SamplingParams(), 3).seqs[0]
    assert bm.allocate(revived, 9)
    assert revived.num_cached_tokens == 4 and revived.block_table[0] == a   # A revived from the free list
    assert bm.blocks[a].ref_count == 1 and a not in bm.free_list


def test_chunked_prefill_and_decode_share_a_step():
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=4, max_tokens_per_step=8)
    short = sim.add([1, 2, 3], 5).seqs[0]
    sim.step()                                           # short prefills (3 tokens) and samples
    long = sim.add(list(range(500, 520)), 2).seqs[0]
    batch = sim.step()
    assert (short, 1) in batch.items                     # its decode token
    assert (long, 7) in batch.items                      # a prefill chunk filling the rest of the budget
    sim.check()
    sim.drain()
    sim.check()


def test_preemption_takes_latest_arrival_and_recomputes():
    sim = Sim(num_blocks=6, block_size=4, max_num_seqs=3, max_tokens_per_step=64, caching=False)
    seqs = [sim.add(list(range(10 * i, 10 * i + 7)), 12).seqs[0] for i in range(3)]
    for _ in range(40):
        if sim.sched.num_preemptions:
            break
        sim.step()
        sim.check()
    assert sim.sched.num_preemptions >= 1
    assert seqs[-1].num_preemptions >= 1 and seqs[0].num_preemptions == 0
    assert sim.sched.waiting[0] is seqs[-1]
    sim.drain()
    sim.check()
    assert all(s.is_finished and s.num_output_tokens == 12 for s in seqs)
    assert sim.bm.num_free_blocks == 6


def test_max_num_seqs_and_fcfs_admission():
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=2, max_tokens_per_step=64)
    seqs = [sim.add([i, i + 1, i + 2], 3).seqs[0] for i in range(0, 12, 3)]
    sim.step()
    assert [s.status for s in seqs] == [SequenceStatus.RUNNING] * 2 + [SequenceStatus.WAITING] * 2
    sim.drain()
    assert all(s.is_finished for s in seqs)


def test_abort_frees_blocks_immediately():
    sim = Sim(num_blocks=10, block_size=4, max_num_seqs=2, max_tokens_per_step=64)
    seq = sim.add(list(range(9)), 50).seqs[0]
    sim.step()
    assert sim.bm.num_free_blocks < 10
    sim.finish(seq)
    sim.check()
    assert sim.bm.num_free_blocks == 10


def test_block_manager_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(BlockManager(4, 16), 0, 16)


PROMPT_HEADS = [(1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9), (5, 5, 5, 5)]


def test_property_run_exercises_preemption_and_prefix_hits():
    """The random pools above are small enough to preempt; make sure that path is really taken."""
    sim = Sim(num_blocks=6, block_size=4, max_num_seqs=4, max_tokens_per_step=12)
    for head in PROMPT_HEADS * 2:
        sim.add(list(head) + [1, 2], 4)
    while sim.sched.has_unfinished():
        sim.step()
        sim.check()
    assert sim.sched.num_preemptions > 0 and sim.bm.prefix_cache_hits > 0
    assert sim.bm.num_free_blocks == 6
