"""From a step's logits to one token per sequence, in vLLM's order: the logits processors (penalties,
logit_bias, min_tokens, allowed ids, bad words: logits_processors.py), the grammar's token bitmask
(`ops.apply_token_bitmask`, one matcher per constrained sequence), min_p, then greedy or seeded sampling
(`ops.sample`: temperature, top-k, top-p). Every stage is a batched op over the rows that use it, and each
row's result depends on nothing but that row, so seeded sampling stays batch-invariant. The sampled token's
logprob, rank and the top-k logprobs (when asked) are the raw model's, taken before any processor.

Rows that verify a draft model's drafts under the `rejection` rule (speculative.py: a sequence's k + 1
DraftPosition rows, with the draft's logits) are sampled together by `ops.rejection_sample` instead: the
accepted drafts and one more token, one SampleResult each."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernel_lab import ops

from .grammar import fill_step_bitmask
from .logits_processors import apply_logits_processors, apply_min_p, build_logits_state
from .outputs import Logprob
from .sequence import Sequence


@dataclass
class SampleResult:
    seq: Sequence
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None   # (token id, logprob), most likely first
    rank: int | None = None                                # the sampled token's rank (1 = most likely)
    distribution: torch.Tensor | None = None               # the processed logits row, where the view asks


class Sampler:
    """`to_device(name, values, dtype)` moves a host list to the logits' device (the runner's staging)."""

    def __init__(self, seed: int, to_device: Callable[[str, list, torch.dtype], torch.Tensor]):
        self.rng = random.Random(seed)
        self._to_device = to_device

    def step_seed(self, seq: Sequence) -> int:
        """Seeded requests: a seed from (request seed, completion index, position), so the same request
        gives the same tokens whatever it is batched with. Others: the engine's random stream."""
        seed = seq.params.seed
        if seed is None:
            return self.rng.getrandbits(63)
        # a draft model's proposals (`key_salt`) draw with keys of their own, independent of the target's
        return hash((seed, seq.index, seq.num_output_tokens) + getattr(seq, "key_salt", ())) & ((1 << 63) - 1)

    def sample_each(self, logits: torch.Tensor, seqs: list[Sequence]
                    ) -> tuple[list[SampleResult], list[tuple[Sequence, Exception]]]:
        """`sample`, with each row's failure its own: (results, [(sequence, its exception)]).

        The batch is sampled whole, as always; only when that raises are its rows sampled one at a time,
        to find the rows whose parameters fail (a processor, the grammar's bitmask, top-k...). A row's
        result depends on that row alone (see the module docstring), so the others' tokens are those the
        whole batch would have given, and the normal step pays nothing for the isolation. A fault that
        every row hits alone belongs to no request (the device, the kernels): it is raised."""
        try:
            return self.sample(logits, seqs), []
        except Exception as batch_error:
            results, failed = [], []
            units: dict[int, list[int]] = {}    # a sequence's rows stay together (a verify group)
            for row, seq in enumerate(seqs):
                units.setdefault(id(getattr(seq, "seq", seq)), []).append(row)
            for rows in units.values():
                try:
                    results += self.sample(logits[rows], [seqs[i] for i in rows])
                except Exception as exc:  # noqa: BLE001 - this request's fault, reported in its output
                    failed.append((seqs[rows[0]], exc))
            if len(failed) == len(units) > 1:
                raise batch_error
            return results, failed

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
        if not seqs:
            return []
        groups = _verify_groups(seqs)
        if groups:
            return self._sample_verified(logits, seqs, groups)
        params = [s.params for s in seqs]
        to_device = self._to_device
        temperature = None
        if not all(p.greedy for p in params):
            temperature = to_device("temperature", [0.0 if p.greedy else p.temperature for p in params],
                                    torch.float32)
        processed = self.process(logits, seqs, temperature)
        if temperature is None:
            tokens = processed.argmax(dim=-1)
        else:
            tokens = ops.sample(
                processed,
                temperature,
                # top_k at or past the vocabulary is off (ops.sample's rule), and then fits in int32
                top_k=to_device("top_k", [min(max(p.top_k, 0), logits.shape[1]) for p in params], torch.int32),
                top_p=to_device("top_p", [p.top_p for p in params], torch.float32),
                seed=to_device("seed", [self.step_seed(s) for s in seqs], torch.int64),
            )
        want = [p.logprobs for p in params]
        if all(w is None for w in want):
            results = [SampleResult(s, t) for s, t in zip(seqs, tokens.tolist(), strict=True)]
        else:
            results = _with_logprobs(logits, tokens, seqs, want)
        if any(getattr(s, "keep_distribution", False) for s in seqs):
            kept = processed.float()
            for i, r in enumerate(results):
                if getattr(r.seq, "keep_distribution", False):
                    r.distribution = kept[i].clone()
        return results

    def _sample_verified(self, logits, seqs, groups) -> list[SampleResult]:
        """`sample` for a batch with verify groups: the other rows as usual; each group's rows processed as
        the sequence would be at those positions and passed with its drafts and the draft's logits to
        ops.rejection_sample (each row's key: the target's step_seed there). A group's results are its
        emitted tokens only: the accepted drafts, then the residual or bonus draw."""
        grouped = {i for _, rows in groups for i in rows}
        plain = [i for i in range(len(seqs)) if i not in grouped]
        results = self.sample(logits[plain], [seqs[i] for i in plain]) if plain else []
        rows = [i for _, r in groups for i in r]
        views = [seqs[i] for i in rows]
        counts = [len(r) - 1 for _, r in groups]
        params = [seq.params for seq, _ in groups]
        to_device = self._to_device
        row_temperature = to_device("verify_row_temperature",
                                    [0.0 if v.params.greedy else v.params.temperature for v in views], torch.float32)
        processed = self.process(logits[rows], views, row_temperature)   # min_p is applied here
        drafts = [t for (seq, _), n in zip(groups, counts, strict=True) for t in seq.draft_token_ids[:n]]
        tokens = ops.rejection_sample(
            processed,
            to_device("verify_drafts", drafts, torch.int64),
            counts,
            to_device("verify_temperature", [0.0 if p.greedy else p.temperature for p in params], torch.float32),
            top_k=to_device("verify_top_k", [min(max(p.top_k, 0), logits.shape[1]) for p in params], torch.int32),
            top_p=to_device("verify_top_p", [p.top_p for p in params], torch.float32),
            seed=to_device("verify_seed", [self.step_seed(v) for v in views], torch.int64),
            draft_logits=torch.cat([seq.draft_logits[:n] for (seq, _), n in zip(groups, counts, strict=True)]),
            rule="rejection").tolist()
        emitted_rows, emitted, emitted_views = [], [], []
        start = 0
        for b, n in enumerate(counts):
            for j, token in enumerate(tokens[b][:n + 1]):
                if token < 0:
                    break
                emitted_rows.append(rows[start + j])
                emitted.append(token)
                emitted_views.append(views[start + j])
            start += n + 1
        want = [v.params.logprobs for v in emitted_views]
        if all(w is None for w in want):
            return results + [SampleResult(v, t) for v, t in zip(emitted_views, emitted, strict=True)]
        return results + _with_logprobs(logits[emitted_rows], torch.tensor(emitted, device=logits.device),
                                        emitted_views, want)

    def process(self, logits: torch.Tensor, seqs: list[Sequence], temperature: torch.Tensor | None) -> torch.Tensor:
        """The logits after the processors, the grammar's bitmask and min_p: a float32 copy (the raw
        logits stay for the logprobs), or `logits` itself when no row uses any of them."""
        controls = [s.request.controls for s in seqs]
        matchers = [s.matcher for s in seqs]
        if not any(controls) and not any(m is not None for m in matchers):
            return logits
        out = logits.to(torch.float32, copy=True)
        state = None
        if any(controls):
            state = build_logits_state(
                controls, [s.token_ids[:s.num_prompt_tokens] if c else () for s, c in zip(seqs, controls)],
                [s.output_token_ids if c else () for s, c in zip(seqs, controls)], out.shape[1], out.device)
            apply_logits_processors(out, state)
        masked = fill_step_bitmask(matchers)
        if masked is not None:
            bitmask, rows = masked
            ops.apply_token_bitmask(out, bitmask.to(out.device, non_blocking=True),
                                    rows.to(out.device, non_blocking=True), validate=False)
        if state is not None and state.min_p is not None and temperature is not None:
            apply_min_p(out, state.min_p, temperature)
        return out


def _verify_groups(seqs) -> list[tuple[Sequence, list[int]]]:
    """The rows of sequences whose drafts carry the draft's logits (speculative.DraftPosition rows, offsets
    0..m in batch order), per sequence: [(sequence, row indices)]."""
    groups: dict[int, tuple[Sequence, list[int]]] = {}
    for i, s in enumerate(seqs):
        if getattr(s, "offset", None) is not None and s.draft_logits is not None:
            groups.setdefault(s.seq.seq_id, (s.seq, []))[1].append(i)
    return list(groups.values())


def _with_logprobs(logits, tokens, seqs, want) -> list[SampleResult]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])                                    # [S, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1
    k = max(w or 0 for w in want)
    if k:
        top_vals, top_ids = ops.topk(logprobs, k)
    # One host read for everything.
    tokens_l, chosen_l, ranks_l = tokens.tolist(), chosen[:, 0].tolist(), ranks.tolist()
    top_vals_l = top_vals.tolist() if k else None
    top_ids_l = top_ids.tolist() if k else None
    results = []
    for i, seq in enumerate(seqs):
        r = SampleResult(seq, tokens_l[i])
        if want[i] is not None:
            r.logprob, r.rank = chosen_l[i], ranks_l[i]
            r.top_logprobs = list(zip(top_ids_l[i][:want[i]], top_vals_l[i][:want[i]], strict=True)) if k else []
        results.append(r)
    return results


def score_prompts(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                  chunks: list[tuple[Sequence, int, int, int]], hidden: torch.Tensor) -> None:
    """Prompt logprobs (SamplingParams.prompt_logprobs): lm_head over the rows of the chunks that asked
    (only those), and each row's logprob of the prompt's next token, with its rank and the top candidates,
    into the request. A chunk is (sequence, first row in `hidden`, rows, first position)."""
    for seq, row0, n, start in chunks:
        end = min(start + n, seq.num_prompt_tokens - 1)   # the last prompt row predicts no prompt token
        logprobs = torch.log_softmax(compute_logits(hidden[row0:row0 + end - start]).float(), dim=-1)
        targets = torch.tensor(seq.token_ids[start + 1:end + 1], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])
        ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
        k = seq.params.prompt_logprobs
        tops = [[] for _ in ranks]
        if k:
            values, ids = ops.topk(logprobs, k)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        for i, (lp, rank) in enumerate(zip(chosen[:, 0].tolist(), ranks, strict=True)):
            entry = {t: Logprob(v, r) for r, (t, v) in enumerate(tops[i], start=1)}
            entry.setdefault(int(targets[i]), Logprob(lp, rank))
            seq.request.prompt_logprobs[start + 1 + i] = entry
