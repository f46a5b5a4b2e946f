"""Project 10: verifying a speculative step's draft tokens against the target's logits (rejection sampling).

Layout (vLLM's): B sequences, sequence b with k_b draft tokens (0..MAX_DRAFT_TOKENS); `draft_token_ids` is
the [T] concatenation (T = sum k_b); `target_logits` holds k_b + 1 rows per sequence, [T + B, vocab], the
target's logits at the draft positions and one more (the bonus position); `draft_logits`, when given, the
[T, vocab] draft logits each draft token was sampled from. The result is int64 [B, max k_b + 1]: the emitted
tokens of each sequence (the accepted drafts, then one target token), -1 after them.

Both distributions are processed alike, per sequence, as the sampler does (`speculative_probs`): min_p on
the logits, then temperature, top-k and top-p (project 06's kept set and tie rule), softmax over the kept
set. Temperature 0 makes the target one-hot at its argmax (a greedy row accepts while the draft equals the
target's argmax, then emits the argmax).

Rules. `rejection`: draft token x at position i is accepted with probability min(1, p_i(x) / q_i(x)); at the
first rejection the sequence emits a draw from normalize(max(0, p_i - q_i)); if all k are accepted, a bonus
draw from p_k. `coupled`: each position's target token is `ops.sample`'s keyed draw there (what decoding
without speculation emits), a draft is accepted iff it equals that draw, and the first mismatch emits the
draw. With no `draft_logits` (a deterministic proposer: q one-hot) the standard rule *is* the coupled rule
(accept x with probability p(x), else draw from p without x), so both names run the coupled path.

Randomness is project 06's keyed scheme: `seed` holds one key per target row (the engine's
hash(request seed, completion index, position)); the acceptance uniform and the race variates of a row are
Philox words of that key (keyed_random.py), never of the row's place in the batch. The math, the design
and the tests: projects/10_speculative/README.md.
"""

from __future__ import annotations

import torch

from .common import FLOAT_DTYPES, check_same_device, check_tensor, use_triton
from .keyed_random import accept_uniform, race_exponentials
from .sampling import _INT_DTYPES, _check_values, _per_row, _sanitize, sample
from .speculative_kernel import MAX_DRAFT_TOKENS, rejection_triton

RULES = ("rejection", "coupled")
PLACEHOLDER = -1


# --------------------------------------------------------------------------------------------- processing
def apply_min_p(x: torch.Tensor, min_p: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """float32 logits with the tokens min_p removes set to -inf: softmax(x / T)_i < min_p * max softmax, i.e.
    x_i < max x + T ln(min_p) (the engine's rule, computed the same way in float32, so that the coupled rule
    sees exactly the logits the non-speculative sampler samples from)."""
    live = (min_p > 0) & (temperature > 0)
    x = x.float().clone()
    if not bool(live.any()):
        return x
    floor = x.max(dim=1, keepdim=True).values + temperature[:, None].float() * torch.log(min_p[:, None].float())
    return torch.where(live[:, None] & (x < floor), float("-inf"), x)


def speculative_probs(logits, temperature, top_k=None, top_p=None, min_p=None, dtype=torch.float64):
    """The distribution a row is sampled from, [rows, vocab] in `dtype`: min_p, temperature, top-k (ties keep
    the lowest indices), top-p (the shortest prefix of the ranking whose mass reaches top_p of the top-k
    mass), softmax over the kept set; a greedy row (temperature <= 0) is one-hot at the first index of its
    max. Per-row parameters are [rows] tensors; each row depends on nothing but itself."""
    rows, vocab = logits.shape
    x = _sanitize(logits)
    if min_p is not None:
        x = apply_min_p(x, min_p, temperature)
    best = torch.argmax(x, dim=1)  # the first index of the max
    greedy = ~(temperature > 0) | (x.max(dim=1).values == float("-inf"))
    temps = torch.where(greedy, 1.0, temperature.to(dtype))
    k_on = (top_k > 0) & (top_k < vocab) if top_k is not None else torch.zeros(rows, dtype=torch.bool,
                                                                                 device=x.device)
    p_on = top_p < 1.0 if top_p is not None else torch.zeros_like(k_on)
    if bool((k_on | p_on).any()):
        # a stable sort of the sanitised float32 logits is project 06's ranking: equal logits (and -0.0 with
        # +0.0) keep index order
        xs, order = torch.sort(x, dim=1, descending=True, stable=True)
        xs = xs.to(dtype)
        e = torch.exp((xs - xs[:, :1]) / temps[:, None])
        rank = torch.arange(vocab, device=x.device)
        e = torch.where(~k_on[:, None] | (rank[None, :] < top_k[:, None]), e, 0.0)
        if top_p is not None:
            before = torch.cumsum(e, dim=1) - e
            limit = torch.where(p_on, top_p.to(dtype), 2.0) * e.sum(dim=1)
            e = torch.where((before < limit[:, None]) | (rank[None, :] == 0), e, 0.0)
        probs = torch.zeros_like(e).scatter_(1, order, e)
    else:
        xd = x.to(dtype)
        probs = torch.exp((xd - xd.max(dim=1, keepdim=True).values) / temps[:, None])
    probs = probs / probs.sum(dim=1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(1, best[:, None], 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


# --------------------------------------------------------------------------------------------- layout
class _Layout:
    """Row bookkeeping of a ragged batch (host lists in, device index tensors out; nothing is read back)."""

    def __init__(self, num_draft: list[int], device):
        self.num_draft = num_draft
        self.batch = len(num_draft)
        self.width = max(num_draft, default=0) + 1
        starts = [0]
        for k in num_draft:
            starts.append(starts[-1] + k)
        self.draft_start = torch.tensor(starts, dtype=torch.int32, device=device)           # [B + 1]
        seq_of_draft = [b for b, k in enumerate(num_draft) for _ in range(k)]
        seq_of_row = [b for b, k in enumerate(num_draft) for _ in range(k + 1)]
        self.seq_of_draft = torch.tensor(seq_of_draft, dtype=torch.int64, device=device)    # [T]
        self.seq_of_row = torch.tensor(seq_of_row, dtype=torch.int64, device=device)        # [T + B]
        # [B, width] target row of sequence b at position i, and whether that position holds a draft
        pos = torch.arange(self.width, device=device)
        row0 = self.draft_start[:-1].long() + torch.arange(self.batch, device=device)
        k = torch.tensor(num_draft, dtype=torch.int64, device=device)
        self.k = k
        self.row = row0[:, None] + torch.minimum(pos[None, :], k[:, None])
        self.is_draft = pos[None, :] < k[:, None]
        last = max(sum(num_draft) - 1, 0)  # a k = 0 sequence indexes no draft; keep its index in range
        self.draft_index = (self.draft_start[:-1].long()[:, None] + torch.minimum(pos[None, :], k[:, None] - 1)
                            ).clamp(0, last)


def _emit(layout: _Layout, draft_token_ids, accepted, final_token) -> torch.Tensor:
    """[B, width] tokens: the accepted prefix of the drafts, then `final_token` [B], then PLACEHOLDER.
    `accepted` is [B, width] (False where no draft)."""
    accepted = accepted & layout.is_draft
    n_acc = torch.cumprod(accepted.long(), dim=1).sum(dim=1)
    pos = torch.arange(layout.width, device=accepted.device)
    drafts = draft_token_ids.long()[layout.draft_index] if draft_token_ids.numel() else torch.zeros_like(layout.row)
    out = torch.where(pos[None, :] < n_acc[:, None], drafts, PLACEHOLDER)
    return torch.where(pos[None, :] == n_acc[:, None], final_token[:, None], out)


# --------------------------------------------------------------------------------------------- rules
def _coupled(target_logits, draft_token_ids, layout, temperature, top_k, top_p, min_p, seed):
    per_row = layout.seq_of_row
    x = target_logits
    if min_p is not None:
        x = apply_min_p(_sanitize(x), min_p[per_row], temperature[per_row])
    tokens = sample(x, temperature[per_row], top_k=None if top_k is None else top_k[per_row],
                    top_p=None if top_p is None else top_p[per_row], seed=seed)
    at_pos = tokens[layout.row]
    drafts = draft_token_ids.long()[layout.draft_index] if draft_token_ids.numel() else at_pos
    accepted = drafts == at_pos
    n_acc = torch.cumprod((accepted & layout.is_draft).long(), dim=1).sum(dim=1)
    return _emit(layout, draft_token_ids, accepted, at_pos.gather(1, n_acc[:, None])[:, 0])


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution (unnormalised) a rejected position draws from: max(0, p - q)."""
    return (p - q).clamp_min(0.0)


def rejection_reference(p, q, draft_token_ids, layout: _Layout, seed) -> torch.Tensor:
    """The standard rule in float64 on the CPU, from processed probabilities p [T + B, V] and q [T, V] (zero
    rows for greedy sequences): accept iff u * q(x) < p(x) with u the row's acceptance uniform, then the
    exponential race argmax r(x) / E(x) over the emitting row's r = max(0, p - q) (or p at the bonus)."""
    vocab = p.shape[1]
    u = accept_uniform(seed.cpu())
    drafts = draft_token_ids.long()
    target_rows = layout.row.flatten()[layout.is_draft.flatten()]
    p_x = p[target_rows, drafts]
    q_x = q[torch.arange(drafts.numel()), drafts]
    accepted_flat = u[target_rows] * q_x < p_x
    accepted = torch.zeros_like(layout.is_draft)
    accepted[layout.is_draft] = accepted_flat
    n_acc = torch.cumprod(accepted.long(), dim=1).sum(dim=1)
    rows = layout.row.gather(1, n_acc[:, None])[:, 0]
    rejected = n_acc < layout.k
    r = p[rows].clone()
    if bool(rejected.any()):
        q_rows = layout.draft_index.gather(1, n_acc.clamp_max(layout.width - 1)[:, None])[:, 0]
        resid = _residual(p[rows[rejected]], q[q_rows[rejected]])
        # p - q can only be all zero through rounding (a rejection needs p(x) < q(x)); draw from p then
        r[rejected] = torch.where(resid.sum(dim=1, keepdim=True) > 0, resid, p[rows[rejected]])
    score = r / race_exponentials(seed.cpu()[rows], vocab)
    best = score.max(dim=1, keepdim=True).values
    idx = torch.arange(vocab)
    final = torch.where(score == best, idx, vocab).min(dim=1).values
    return _emit(layout, drafts, accepted, final)


# --------------------------------------------------------------------------------------------- public op
def _check_inputs(target_logits, draft_token_ids, num_draft_tokens, draft_logits, seed, rule):
    check_tensor("target_logits", target_logits, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("draft_token_ids", draft_token_ids, dtypes=_INT_DTYPES, ndim=1)
    check_tensor("seed", seed, dtypes=_INT_DTYPES, ndim=1)
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if isinstance(num_draft_tokens, torch.Tensor) or not all(
            isinstance(k, int) and not isinstance(k, bool) for k in num_draft_tokens):
        raise TypeError("num_draft_tokens must be a list of ints (host metadata, one per sequence)")
    num_draft = list(num_draft_tokens)
    if not num_draft:
        raise ValueError("num_draft_tokens must name at least one sequence")
    if not all(0 <= k <= MAX_DRAFT_TOKENS for k in num_draft):
        raise ValueError(f"num_draft_tokens must each be in 0..{MAX_DRAFT_TOKENS}, got {num_draft}")
    total, batch = sum(num_draft), len(num_draft)
    vocab = target_logits.shape[1]
    if vocab < 1:
        raise ValueError("target_logits must have a vocabulary (last dimension) of at least 1")
    if target_logits.shape[0] != total + batch:
        raise ValueError(f"target_logits must have sum(num_draft_tokens) + len(num_draft_tokens) = {total + batch} "
                         f"rows (k + 1 per sequence), got {target_logits.shape[0]}")
    if draft_token_ids.shape[0] != total:
        raise ValueError(f"draft_token_ids must have sum(num_draft_tokens) = {total} entries, "
                         f"got {draft_token_ids.shape[0]}")
    if seed.shape[0] != total + batch:
        raise ValueError(f"seed must have one key per target row ({total + batch}), got {seed.shape[0]}")
    if draft_logits is not None:
        check_tensor("draft_logits", draft_logits, dtypes=FLOAT_DTYPES, ndim=2)
        if tuple(draft_logits.shape) != (total, vocab):
            raise ValueError(f"draft_logits must have shape ({total}, {vocab}) (one row per draft token), "
                             f"got {tuple(draft_logits.shape)}")
    check_same_device(target_logits=target_logits, draft_token_ids=draft_token_ids, seed=seed,
                      draft_logits=draft_logits)
    if target_logits.device.type == "cpu" and total:
        low, high = int(draft_token_ids.min()), int(draft_token_ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"draft_token_ids must be in [0, {vocab}), got values in [{low}, {high}]")
    return num_draft


def rejection_sample(target_logits: torch.Tensor, draft_token_ids: torch.Tensor, num_draft_tokens: list[int],
                     temperature, *, seed: torch.Tensor, draft_logits: torch.Tensor | None = None,
                     top_k=None, top_p=None, min_p=None, rule: str = "rejection") -> torch.Tensor:
    """Verify draft tokens (see the module docstring for the layout and the rules): int64 [B, max k + 1].

    temperature, top_k, top_p, min_p: per sequence, [B] tensors or numbers, with `ops.sample`'s meanings
    (min_p in [0, 1], 0 = off). seed: int64 [T + B], one key per target row. Values are checked when the
    tensors are on the CPU; on CUDA nothing is read back.

    Paths: `coupled` (and any call without draft_logits) is `ops.sample` over the target rows plus a prefix
    compare, on every device. `rejection` with draft_logits: the Triton kernel on CUDA (or the CPU under
    TRITON_INTERPRET=1), else `rejection_reference` in float64 (the CPU path).
    """
    num_draft = _check_inputs(target_logits, draft_token_ids, num_draft_tokens, draft_logits, seed, rule)
    batch, device = len(num_draft), target_logits.device
    float_dtypes = (*FLOAT_DTYPES, torch.float64)
    temperature = _per_row("temperature", temperature, batch, device, float_dtypes, "float")
    top_k = None if top_k is None else _per_row("top_k", top_k, batch, device, _INT_DTYPES, "integer")
    top_p = None if top_p is None else _per_row("top_p", top_p, batch, device, float_dtypes, "float")
    min_p = None if min_p is None else _per_row("min_p", min_p, batch, device, float_dtypes, "float")
    check_same_device(target_logits=target_logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    if device.type == "cpu":
        _check_values(temperature, top_k, top_p)
        if min_p is not None and not bool(((min_p >= 0) & (min_p <= 1)).all()):
            raise ValueError("min_p must be in [0, 1] (0 = off)")
    layout = _Layout(num_draft, device)
    if draft_logits is None or rule == "coupled":
        return _coupled(target_logits, draft_token_ids, layout, temperature, top_k, top_p, min_p, seed)
    triton_path = use_triton(target_logits)
    dtype = torch.float32 if triton_path else torch.float64
    p, q = _processed(target_logits, draft_logits, layout, temperature, top_k, top_p, min_p, dtype)
    if triton_path:
        return rejection_triton(p, q, draft_token_ids, layout, seed)
    return rejection_reference(p, q, draft_token_ids, layout, seed)


def _processed(target_logits, draft_logits, layout, temperature, top_k, top_p, min_p, dtype):
    """p [T + B, V] and q [T, V] with each sequence's parameters; q is zero on greedy sequences, where
    acceptance is `p(x) > 0` (x is the argmax) and the residual is p itself (one-hot at the argmax)."""
    def per(index):
        return [None if t is None else t[index] for t in (temperature, top_k, top_p, min_p)]

    p = speculative_probs(target_logits, *per(layout.seq_of_row), dtype=dtype)
    q = speculative_probs(draft_logits, *per(layout.seq_of_draft), dtype=dtype)
    greedy_draft = ~(temperature[layout.seq_of_draft] > 0)
    q = torch.where(greedy_draft[:, None], 0.0, q)
    return p.contiguous(), q.contiguous()


__all__ = ["rejection_sample", "rejection_reference", "speculative_probs", "apply_min_p", "MAX_DRAFT_TOKENS",
           "RULES", "PLACEHOLDER"]
