"""Continuous batching: which sequences run in the next step, and how many of their tokens (chunked prefill
under a token budget, FCFS admission, preemption by recompute). The policy: projects/09_engine/README.md,
"Scheduling".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)   # (sequence, tokens to compute)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.lora = None    # the LoRAManager (lora.py) when LoRA is enabled: a sequence needs its adapter's slot

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------------------------------- step
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens + len(seq.draft_token_ids), budget)
            seq.draft_token_ids = seq.draft_token_ids[:num_new - 1]     # a short budget takes fewer drafts
            while not bm.append_slots(seq, num_new):
                victim = self.running.pop()  # latest arrival; never one already scheduled (index >= i)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.items.append((seq, num_new))
                budget -= num_new
                i += 1
                continue
            break

        # Admitting while preempting would only thrash: wait until running sequences free blocks.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            seq = self.waiting[0]
            if self.lora is not None and not self.lora.can_admit(seq):
                break
            if not bm.allocate(seq, budget):
                break
            if self.lora is not None:
                self.lora.acquire(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            batch.items.append((seq, num_new))
            budget -= num_new
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if self.lora is not None:
            self.lora.release(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids, seq.draft_masks = [], []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Running sequences arrived before every never-admitted one, so inserting by arrival puts it at
        # the front, in FCFS order with others preempted earlier.
        position = 0
        while position < len(self.waiting) and self.waiting[position].arrival <= seq.arrival:
            position += 1
        self.waiting.insert(position, seq)

    def update_computed(self, batch: ScheduledBatch) -> list[Sequence]:
        """After the model ran: advance each sequence's computed count and register its new full blocks.
        Returns the sequences whose tokens are now all computed (they receive a sampled token)."""
        for seq, num_new in batch.items:
            # drafts count once accepted (Speculator.rollback), so nothing of theirs is committed here
            seq.num_computed_tokens += num_new - len(seq.draft_token_ids)
            self.block_manager.commit(seq)
        return [seq for seq, _ in batch.items if seq.num_computed_tokens == seq.num_tokens]

    # ------------------------------------------------------------------------------------------- removal
    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence (running or waiting) and free its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.block_manager.free(seq)
        if self.lora is not None:
            self.lora.release(seq)
        seq.status = SequenceStatus.FINISHED
