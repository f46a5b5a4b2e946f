"""Paged KV blocks: reference counts, prefix caching by hash-chaining full blocks, LRU eviction. Block i of a
sequence's block table holds its tokens [i*block_size, (i+1)*block_size). The design, and why sharing can
never let one sequence overwrite another's K/V: projects/09_engine/README.md, "Prefix caching".
"""

from __future__ import annotations

from collections import OrderedDict

from .lora import prefix_root
from .sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None   # kept to rule out hash collisions

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.hash is not None})"


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_list: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}       # chain hash -> block id
        self.fresh_block_ids: list[int] = []   # handed out empty since the last drain (fp8 scales reset)
        self.prefix_cache_queries = 0          # prompt tokens looked up
        self.prefix_cache_hits = 0             # of which found in the cache

    # ------------------------------------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_needed(num_tokens, self.block_size)

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """Chain hashes of the first `num_full_blocks` blocks (computed once); the first's parent: its LoRA adapter."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else prefix_root(seq),
                                     tuple(seq.token_ids[i * bs:(i + 1) * bs])))
        return hashes[:num_full_blocks]

    def _lookup(self, seq: Sequence) -> list[int]:
        """Leading cached blocks of a sequence with no blocks yet. At least one token is always left to
        compute (its logits give the next token), so a fully cached prompt gives back its last block."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits = []
        for i, h in enumerate(self._block_hashes(seq, (seq.num_tokens - 1) // bs)):
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(block_id)
        return hits

    # ------------------------------------------------------------------------------------------- mutation
    def _take_free_block(self) -> int:
        block_id, _ = self.free_list.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: its contents are about to be overwritten
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash = block.token_ids = None
        block.ref_count = 1
        self.fresh_block_ids.append(block_id)
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_list[block_id]
        block.ref_count += 1

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Admit a sequence that holds no blocks: reuse its cached prefix, then take blocks for
        `num_new_tokens` more tokens. Sets num_computed_tokens to the cached length. All or nothing."""
        assert not seq.block_table, "allocate() is for sequences without blocks"
        # prompt logprobs need every prompt row's logits: nothing may come from the cache
        hits = [] if seq.params.prompt_logprobs is not None else self._lookup(seq)
        num_cached = len(hits) * self.block_size
        num_new_tokens = min(num_new_tokens, seq.num_tokens - num_cached)
        needed_new = self.blocks_for(num_cached + num_new_tokens) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if needed_new + revived > len(self.free_list):
            return False
        for block_id in hits:
            self._ref(block_id)
        seq.block_table = hits + [self._take_free_block() for _ in range(needed_new)]
        seq.num_computed_tokens = num_cached
        seq.num_cached_tokens = num_cached
        seq.num_committed_blocks = len(hits)
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += num_cached
        return True

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more computed tokens of a running sequence. All or nothing."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > len(self.free_list):
            return False
        seq.block_table.extend(self._take_free_block() for _ in range(max(needed, 0)))
        return True

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's newly completed full blocks (K/V computed) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_committed_blocks:
            return
        hashes = self._block_hashes(seq, num_full)
        bs = self.block_size
        for i in range(seq.num_committed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self.cached:
                block.hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                self.cached[block.hash] = block.block_id
        seq.num_committed_blocks = num_full

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (rejected speculative slots). They hold
        nothing computed, so none of them is in the prefix cache."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_list[block_id] = None

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Tail blocks go to the free list first, so under LRU they are
        evicted before the head blocks, which are the likelier to be shared prefixes."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} released more often than taken"
            if block.ref_count == 0:
                self.free_list[block_id] = None
        seq.block_table = []
        seq.num_committed_blocks = 0

    def drain_fresh_blocks(self) -> list[int]:
        fresh, self.fresh_block_ids = self.fresh_block_ids, []
        return fresh

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.cached.values()):
            block = self.blocks[block_id]
            block.hash = block.token_ids = None
        self.cached.clear()
