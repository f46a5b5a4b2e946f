"""Draft-model proposals (vLLM's `{"model": PATH, "num_speculative_tokens": k}`): a second, smaller or
quantized model with the target's vocabulary proposes each speculating sequence's k drafts, batched over all
of them, from its own paged KV cache.

The draft keeps a shadow of every running sequence it drafted for (`DraftSequence`): the tokens whose K/V are
in its cache, its block table in its own BlockManager (prefix caching on, so prompts shared across requests
share draft blocks too). A proposal is k rounds over the batch:
- round 0 catches each shadow up to its sequence (its prompt the first time; afterwards the tokens the last
  verify emitted, one to k + 1) and samples draft 1 from the last row;
- rounds 1..k-1 decode one token per shadow (the previous draft) and sample the next.
Each draft is sampled as the target samples that position (`DraftPosition`: the request's parameters and
keyed seed at that position, penalties on the drafts so far); greedy rows take the draft's argmax. Sampled
rows follow speculative_config's acceptance method:
- `rejection_sampler` (the default, vLLM's): the draft draws from its own q with keys of its own
  (`ProposalPosition`) and keeps q's processed logits; the target's sampler verifies by rejection sampling
  (`ops.rejection_sample`, rule `rejection`): the output is distributed as the target's, reproducible per
  seed for a given schedule of draft lengths;
- `coupled`: the draft draws with the target's keys, and a draft is accepted iff it equals the target's
  own draw there, so the output is the output without speculation, token for token; only the acceptance
  rate depends on the draft.

Before a proposal the shadow keeps the longest prefix of its K/V that still matches its sequence (the
accepted drafts' K/V stay; a rejected draft's do not), gives back the blocks past it, and registers only
blocks of the sequence's real tokens in the prefix cache. A shadow whose sequence stopped running (finished,
aborted, preempted) is freed at the next proposal. A shadow the draft's pool cannot hold drafts nothing that
step (never an error): the target's own pool bounds what runs.
"""

from __future__ import annotations

from .block_manager import BlockManager
from .sampling_params import SamplingParams


class _ShadowRequest:
    """What the runner and block manager read of a request: no prompt logprobs, no adapter."""

    prompt_logprobs = None
    lora_request = None


_SHADOW_REQUEST = _ShadowRequest()
_SHADOW_PARAMS = SamplingParams()


class DraftSequence:
    """A target sequence as the draft's runner sees it: its tokens, the draft's computed count and blocks."""

    def __init__(self, seq):
        self.seq = seq
        self.token_ids: list[int] = list(seq.token_ids)
        self.num_computed_tokens = 0
        self.synced = 0                     # tokens of `seq` known equal to token_ids (the last sync)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.num_committed_blocks = 0
        self.num_cached_tokens = 0
        self.draft_token_ids: list[int] = []
        self.index = seq.index
        self.request = _SHADOW_REQUEST
        self.params = _SHADOW_PARAMS

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens


class DraftModelProposer:
    """The draft's engine: speculative_config's `model` and `weights`; the rest is the target's (device,
    dtype, lengths, block size and its pool's block count)."""

    def __init__(self, model: str, weights: str, target_config, rule: str = "rejection"):
        from .config import EngineConfig
        from .model_loader import load_model
        from .model_runner import ModelRunner

        t = target_config
        self.rule = rule                    # ops.rejection_sample's: "rejection" or "coupled"
        self.config = EngineConfig(model, dtype=t.dtype, device=t.device, weights=weights,
                                   max_model_len=t.max_model_len, max_num_seqs=t.max_num_seqs,
                                   max_num_batched_tokens=t.max_num_batched_tokens, block_size=t.block_size,
                                   num_kv_blocks=t.num_kv_blocks, enable_prefix_caching=True, enforce_eager=True,
                                   seed=t.seed)
        if self.config.vocab_size != t.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary has {self.config.vocab_size} "
                             f"tokens and the target's {t.vocab_size}; they must share one tokenizer")
        model, self.tokenizer = load_model(self.config)
        self.runner = ModelRunner(self.config, model)
        self.block_manager = BlockManager(self.config.num_kv_blocks, self.config.block_size, True)
        self.shadows: dict[int, DraftSequence] = {}

    # ------------------------------------------------------------------------------------------- state
    def forget_all_but(self, running) -> None:
        live = {seq.seq_id for seq in running}
        for seq_id in [i for i in self.shadows if i not in live]:
            self.block_manager.free(self.shadows.pop(seq_id))

    def _sync(self, seq) -> DraftSequence | None:
        """The shadow of `seq`, its K/V cut to the prefix still equal to seq's tokens; None if the draft's
        pool cannot hold its next round-0 tokens."""
        bm = self.block_manager
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = DraftSequence(seq)
            if not bm.allocate(shadow, shadow.num_tokens):
                return None
            self.shadows[seq.seq_id] = shadow
            return shadow
        new, old = seq.token_ids, shadow.token_ids
        keep = shadow.synced
        limit = min(shadow.num_computed_tokens, len(new))
        while keep < limit and old[keep] == new[keep]:
            keep += 1
        keep = min(keep, len(new) - 1)      # the last token's logits give the first draft: always computed
        shadow.token_ids = list(new)
        shadow.num_computed_tokens = keep
        del shadow.block_hashes[keep // bm.block_size:]
        bm.truncate(shadow, keep)
        if not bm.append_slots(shadow, shadow.num_tokens - keep):
            bm.free(self.shadows.pop(seq.seq_id))
            return None
        return shadow

    # ------------------------------------------------------------------------------------------- proposal
    def propose(self, pending: list[tuple[object, int]], running) -> None:
        """Set `draft_token_ids` (up to k each) for the (sequence, k) pairs of `pending`."""
        from .speculative import DraftPosition, ProposalPosition

        position = ProposalPosition if self.rule == "rejection" else DraftPosition
        self.forget_all_but(running)
        active = []
        for seq, k in pending:
            shadow = self._sync(seq)
            if shadow is not None:
                active.append((seq, shadow, k))
        items = [(shadow, shadow.num_tokens - shadow.num_computed_tokens) for _, shadow, _ in active]
        rounds = 0
        q_rows: dict[int, list] = {}        # seq_id -> the draft's processed logits per draft (rejection)
        while active:
            by_seq = {seq.seq_id: (seq, shadow, k) for seq, shadow, k in active}
            results, failures = self.runner.execute(
                items, self.block_manager.drain_fresh_blocks(),
                sample_as=lambda shadows: [position(s.seq, len(s.seq.draft_token_ids)) for s in shadows])
            failed = {view.seq.seq_id for view, _ in failures}
            for shadow, n in items:
                shadow.num_computed_tokens += n
                if rounds == 0:     # every computed token is the sequence's own: its full blocks may be shared
                    shadow.synced = shadow.num_computed_tokens
                    self.block_manager.commit(shadow)
            nxt = []
            for r in results:
                seq, shadow, k = by_seq[r.seq.seq.seq_id]
                if seq.seq_id in failed:
                    continue
                seq.draft_token_ids.append(r.token_id)
                shadow.token_ids.append(r.token_id)
                if r.distribution is not None and not seq.params.greedy:
                    q_rows.setdefault(seq.seq_id, []).append(r.distribution)
                if len(seq.draft_token_ids) < k and self.block_manager.append_slots(shadow, 1):
                    nxt.append((seq, shadow, k))
            active = nxt
            items = [(shadow, 1) for _, shadow, _ in active]
            rounds += 1
        if q_rows:
            import torch

            for seq, _ in pending:
                rows = q_rows.get(seq.seq_id)
                if rows and len(rows) == len(seq.draft_token_ids):
                    seq.draft_logits = torch.stack(rows)
