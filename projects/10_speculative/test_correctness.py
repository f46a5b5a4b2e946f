"""Project 10 correctness: verifying draft tokens (`ops.rejection_sample`), both rules.

Without CUDA the Triton kernel runs through the interpreter (conftest.py) on small, odd vocabularies; on a
GPU the same tests run the compiled kernel. Expected distributions come from `kept_probs` here (a stable
float64 sort per row), never from the op's own processing.

- Exactness: the kernel (on `device`) and the float64 reference (on the CPU) read the same Philox words, so
  the same seeds give the same tokens; checked on ragged batches (k = 0..8) with every parameter mixed in.
- Distribution: the emitted token at each position is distributed as the target's p there. Pearson
  chi-square at ALPHA = 1e-3 per position (fixed seeds, so a run is deterministic; a correct sampler fails
  a given check for one seed in a thousand). The reference takes large samples; the interpreted kernel a few
  hundred sequences. `test_chi_square_fails_when_the_residual_is_p` runs the same check with the residual
  step drawing from p instead of max(0, p - q) and requires it to fail.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

import kernel_lab.ops.speculative as spec
import kernel_lab.ops.speculative_kernel as spec_kernel
from kernel_lab.engine.logits_processors import apply_min_p as engine_apply_min_p
from kernel_lab.harness.compile import check_no_spills, compile_module
from kernel_lab.harness.env import interpreter_active
from kernel_lab.harness.testing import case_seed, chi_square_pvalue, empty_poisoned
from kernel_lab.ops import rejection_sample, sample
from kernel_lab.ops.keyed_random import accept_uniform, race_exponentials
from kernel_lab.ops.speculative_kernel import _accept_uniforms, _exponential_tile

ALPHA = 1e-3
NEG_INF = float("-inf")


# --- independent definitions ---------------------------------------------------------------------------
def kept_probs(row: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
               min_p: float = 0.0) -> torch.Tensor:
    """float64 probabilities one row is sampled from: min_p on the float32 logits (x < max + T ln min_p
    goes), then temperature, top-k, top-p (stable descending sort: equal logits keep index order)."""
    x32 = torch.nan_to_num(row.float(), nan=NEG_INF, posinf=torch.finfo(torch.float32).max, neginf=NEG_INF)
    vocab = x32.numel()
    if temperature <= 0 or x32.max() == NEG_INF:
        out = torch.zeros(vocab, dtype=torch.float64)
        out[int(torch.sort(x32.double(), descending=True, stable=True).indices[0])] = 1.0
        return out
    if min_p > 0:
        floor = x32.max() + torch.tensor(temperature, dtype=torch.float32) * torch.log(torch.tensor(min_p))
        x32 = torch.where(x32 < floor, NEG_INF, x32)
    x = x32.double()
    order = torch.sort(x, descending=True, stable=True).indices
    e = torch.exp((x[order] - x.max()) / temperature)
    if 0 < top_k < vocab:
        e[top_k:] = 0.0
    if top_p < 1.0:
        before = torch.cumsum(e, 0) - e
        keep = before < top_p * e.sum()
        keep[0] = True
        e = torch.where(keep, e, 0.0)
    out = torch.zeros(vocab, dtype=torch.float64)
    out[order] = e / e.sum()
    return out


def test_chi_square_pvalue_matches_tabulated_quantiles():
    # chi-square tables: P(X > 3.841 | 1 dof) = 0.05, P(X > 13.277 | 4 dof) = 0.01
    for stat, dof, sf in [(3.841, 1, 0.05), (13.277, 4, 0.01)]:
        value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                              torch.tensor(stat / 2, dtype=torch.float64)))
        assert math.isclose(value, sf, rel_tol=2e-3)


# --- the keyed stream ----------------------------------------------------------------------------------
@triton.jit
def _stream_probe(seed_ptr, race_ptr, accept_ptr, V: tl.constexpr):
    r = tl.program_id(0)
    seed = tl.load(seed_ptr + r)
    tl.store(race_ptr + r * V + tl.arange(0, V), _exponential_tile(seed, 0, V))
    tl.store(accept_ptr + r + tl.arange(0, 1), _accept_uniforms(seed + tl.zeros([1], tl.int64)))


def test_cpu_stream_is_the_kernels_philox(device):
    seeds = torch.tensor([0, 1, -5, 2**62 + 7, -(2**63)], dtype=torch.int64)
    race = torch.empty((5, 64), device=device)
    accept = torch.empty(5, device=device)
    _stream_probe[(5,)](seeds.to(device), race, accept, V=64)
    assert torch.equal(accept.cpu().double(), accept_uniform(seeds))  # exact: 23 bits + 0.5 fit float32
    torch.testing.assert_close(race.cpu().double(), race_exponentials(seeds, 64), rtol=1e-6, atol=0)


# --- batches -------------------------------------------------------------------------------------------
def random_batch(num_draft, vocab, seed, dtype=torch.float32, draft_from_q=True):
    """Target and draft logits (with -inf entries), per-sequence parameters mixing greedy, top-k, top-p and
    min_p, drafts drawn from the draft distribution (so some are accepted), per-row seeds."""
    g = torch.Generator().manual_seed(seed)
    total, batch = sum(num_draft), len(num_draft)
    target = torch.randn(total + batch, vocab, generator=g) * 2
    draft = target[[r for b, k in enumerate(num_draft) for r in range(sum(num_draft[:b]) + b,
                                                                       sum(num_draft[:b]) + b + k)]]
    draft = draft + torch.randn(total, vocab, generator=g)  # a draft near the target accepts often
    target[torch.rand(target.shape, generator=g) < 0.1] = NEG_INF
    draft[torch.rand(draft.shape, generator=g) < 0.2] = NEG_INF
    params = {
        "temperature": torch.where(torch.rand(batch, generator=g) < 0.2, 0.0, 0.5 + torch.rand(batch, generator=g)),
        "top_k": torch.where(torch.rand(batch, generator=g) < 0.5, torch.randint(1, vocab, (batch,), generator=g), 0),
        "top_p": torch.where(torch.rand(batch, generator=g) < 0.5, 0.5 + 0.5 * torch.rand(batch, generator=g), 1.0),
        "min_p": torch.where(torch.rand(batch, generator=g) < 0.3, 0.1 * torch.rand(batch, generator=g), 0.0),
    }
    seq = [b for b, k in enumerate(num_draft) for _ in range(k)]
    if draft_from_q and total:
        q = torch.stack([kept_probs(draft[i], *(params[n][seq[i]].item() for n in params)) for i in range(total)])
        q = torch.where(params["temperature"][seq][:, None] > 0, q, 1.0)  # greedy rows: any draft
        drafts = torch.multinomial(q, 1, generator=g)[:, 0]
    else:
        drafts = torch.randint(0, vocab, (total,), generator=g)
    seeds = torch.randint(-(2**63), 2**63 - 1, (total + batch,), generator=g)
    return target.to(dtype), draft.to(dtype), drafts, params, seeds


def reference_tokens(target, draft, drafts, num_draft, params, seeds):
    """The float64 reference on the CPU, from the op's own processing at float64."""
    cpu = {n: v.cpu() for n, v in params.items()}
    layout = spec._Layout(num_draft, "cpu")
    p, q = spec._processed(target.cpu(), draft.cpu(), layout, cpu["temperature"], cpu["top_k"], cpu["top_p"],
                           cpu["min_p"], torch.float64)
    return spec.rejection_reference(p, q, drafts.cpu(), layout, seeds.cpu())


def run(target, draft, drafts, num_draft, params, seeds, device, **kw):
    on = {n: v.to(device) for n, v in params.items()}
    return rejection_sample(target.to(device), drafts.to(device), num_draft, on.pop("temperature"),
                            seed=seeds.to(device), draft_logits=None if draft is None else draft.to(device),
                            **on, **kw)


# --- exactness -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab, num_draft, dtype", [
    (37, [1, 2, 3, 4, 5, 6, 7, 8], torch.float32),
    (101, [8, 0, 3, 1, 8], torch.bfloat16),
    (1000, [4, 2, 0, 6], torch.float16),
])
def test_kernel_gives_the_references_tokens(vocab, num_draft, dtype, device):
    batch = random_batch(num_draft, vocab, case_seed("exact", vocab, dtype))
    target, draft, drafts, params, seeds = batch
    got = run(*batch[:3], num_draft, params, seeds, device)
    want = reference_tokens(target, draft, drafts, num_draft, params, seeds)
    assert torch.equal(got.cpu(), want), (got, want)
    emitted = (want >= 0).sum(dim=1)
    assert bool((emitted >= 1).all()) and bool((emitted <= torch.tensor(num_draft) + 1).all())


def test_kernel_streams_a_row_in_several_chunks(device, monkeypatch):
    monkeypatch.setattr(spec_kernel, "MAX_CHUNK", 16)  # 99 tokens in 7 chunks: the cross-chunk argmax runs
    num_draft = [3, 5, 1]
    batch = random_batch(num_draft, 99, case_seed("chunks"))
    assert spec_kernel.chunk_for(99) == 16
    assert torch.equal(run(*batch[:3], num_draft, *batch[3:], device).cpu(), reference_tokens(*batch[:3], num_draft,
                                                                                              *batch[3:]))


def test_kernel_writes_every_output_position(device):
    num_draft = [2, 0, 5]
    target, draft, drafts, params, seeds = random_batch(num_draft, 29, case_seed("poison"))
    layout = spec._Layout(num_draft, device)
    on = {n: v.to(device) for n, v in params.items()}
    p, q = spec._processed(target.to(device), draft.to(device), layout, on["temperature"], on["top_k"],
                           on["top_p"], on["min_p"], torch.float32)
    out = empty_poisoned((3, 6), torch.int64, device)
    spec_kernel.rejection_triton(p, q, drafts.to(device), layout, seeds.to(device), out=out)
    assert torch.equal(out.cpu(), reference_tokens(target, draft, drafts, num_draft, params, seeds))


def test_a_sequences_tokens_do_not_depend_on_its_batch(device):
    num_draft = [3, 6, 2, 4]
    target, draft, drafts, params, seeds = random_batch(num_draft, 53, case_seed("invariance"))
    for rule in spec.RULES:
        together = run(target, draft, drafts, num_draft, params, seeds, device, rule=rule)
        rows, d = slice(4, 11), slice(3, 9)  # sequence 1 alone
        alone = run(target[rows], draft[d], drafts[d], [6], {n: v[1:2] for n, v in params.items()}, seeds[rows],
                    device, rule=rule)
        assert torch.equal(together[1:2].cpu(), alone.cpu()), rule


# --- greedy and the coupled rule -----------------------------------------------------------------------
@pytest.mark.parametrize("rule", spec.RULES)
@pytest.mark.parametrize("with_draft_logits", [True, False])
def test_greedy_accepts_while_the_draft_is_the_argmax(rule, with_draft_logits, device):
    vocab, k = 31, 5
    g = torch.Generator().manual_seed(case_seed("greedy"))
    target = torch.randn(3 * (k + 1), vocab, generator=g)
    target[0, 7] = target[0, 3] = 9.0  # a tie: the lower index is the argmax
    argmax = torch.sort(target, dim=1, descending=True, stable=True).indices[:, 0]
    drafts = argmax.reshape(3, k + 1)[:, :k].clone()
    drafts[0, 2] = (drafts[0, 2] + 1) % vocab  # sequence 0: mismatch at position 2
    drafts[1, 0] = (drafts[1, 0] + 1) % vocab  # sequence 1: at position 0; sequence 2: all match
    draft_logits = torch.randn(3 * k, vocab, generator=g) if with_draft_logits else None
    out = rejection_sample(target.to(device), drafts.flatten().to(device), [k] * 3, 0.0, rule=rule,
                           seed=torch.arange(3 * (k + 1), device=device),
                           draft_logits=None if draft_logits is None else draft_logits.to(device)).cpu()
    best = argmax.reshape(3, k + 1)
    assert out[0].tolist() == best[0, :3].tolist() + [-1] * 3
    assert out[1].tolist() == best[1, :1].tolist() + [-1] * 5
    assert out[2].tolist() == best[2].tolist()
    assert best[0, 0] == 3


def test_coupled_emits_the_non_speculative_tokens(device):
    """Each emitted token is the engine's own draw at that position: its min_p (engine code, not this
    op's), then ops.sample with the position's seed."""
    num_draft = [4, 2, 7, 3]
    target, draft, drafts, params, seeds = random_batch(num_draft, 61, case_seed("coupled"))
    # A hot temperature and a high min_p: the min_p floor (max + T ln min_p) decides many draws.
    params["temperature"] = torch.where(params["temperature"] > 0, 2.0, 0.0)
    params["min_p"] = torch.full_like(params["min_p"], 0.3)
    per_row = torch.tensor([b for b, k in enumerate(num_draft) for _ in range(k + 1)])
    x = target.float().clone()
    engine_apply_min_p(x, params["min_p"][per_row], params["temperature"][per_row])
    own = sample(x.to(device), params["temperature"][per_row].to(device), params["top_k"][per_row].to(device),
                 params["top_p"][per_row].to(device), seed=seeds.to(device)).cpu()
    out = run(target, draft, drafts, num_draft, params, seeds, device, rule="coupled").cpu()
    row0 = 0
    for b, k in enumerate(num_draft):
        emitted = out[b][out[b] >= 0]
        assert torch.equal(emitted, own[row0:row0 + emitted.numel()]), b
        accepted = emitted[:-1]
        assert torch.equal(accepted, drafts[row0 - b:row0 - b + accepted.numel()])
        row0 += k + 1
    # A draft that samples with the same keys from the same distribution is always accepted.
    same = own[torch.tensor([r for b, k in enumerate(num_draft) for r in range(sum(num_draft[:b]) + b,
                                                                                sum(num_draft[:b]) + b + k)])]
    full = run(target, draft, same, num_draft, params, seeds, device, rule="coupled").cpu()
    assert torch.equal((full >= 0).sum(dim=1), torch.tensor(num_draft) + 1)


def test_without_draft_probabilities_both_rules_are_the_non_speculative_draws(device):
    """One-hot q (an n-gram proposer): the standard rule is the coupled rule, so under either name every
    emitted token is ops.sample's draw at its position, and n-gram speculation reproduces plain decoding."""
    num_draft = [5, 1, 8]
    target, _, drafts, params, seeds = random_batch(num_draft, 43, case_seed("one-hot"))
    params["min_p"] = torch.zeros_like(params["min_p"])
    per_row = torch.tensor([b for b, k in enumerate(num_draft) for _ in range(k + 1)])
    own = sample(target.to(device), params["temperature"][per_row].to(device), params["top_k"][per_row].to(device),
                 params["top_p"][per_row].to(device), seed=seeds.to(device)).cpu()
    starts = [sum(num_draft[:b]) + b for b in range(len(num_draft))]
    drafts = own[[r for b, k in enumerate(num_draft) for r in range(starts[b], starts[b] + k)]].clone()
    drafts[1] += 1  # sequence 0 rejects at its second draft
    drafts[1] %= 43
    for rule in spec.RULES:
        out = run(target, None, drafts, num_draft, params, seeds, device, rule=rule).cpu()
        for b in range(len(num_draft)):
            emitted = out[b][out[b] >= 0]
            assert torch.equal(emitted, own[starts[b]:starts[b] + emitted.numel()]), (rule, b)
        assert (out >= 0).sum(dim=1).tolist() == [2, 2, 9], rule


# --- distributions -------------------------------------------------------------------------------------
def distribution_case(name):
    """(target rows [k + 1, V], draft rows [k, V], parameters) of one chi-square case; odd vocabularies."""
    g = torch.Generator().manual_seed(case_seed("dist", name))
    vocab, k = {"random": (7, 3), "draft_zeros": (9, 2), "one_hot": (7, 2), "p_equals_q": (11, 2),
                "processed": (13, 2)}[name]
    target = torch.randn(k + 1, vocab, generator=g) * 1.5
    draft = torch.randn(k, vocab, generator=g) * 1.5
    params = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    if name == "draft_zeros":  # q is zero on tokens where p is not
        draft[:, ::2] = NEG_INF
    elif name == "one_hot":  # a deterministic proposer that guesses the target's likeliest token
        draft.fill_(NEG_INF)
        draft[torch.arange(k), target[:k].argmax(dim=1)] = 0.0
    elif name == "p_equals_q":
        draft = target[:k].clone()
    elif name == "processed":
        params = {"temperature": 0.8, "top_k": 9, "top_p": 0.9, "min_p": 0.02}
    return target, draft, params


def emitted_pvalues(name, n, device, path):
    """Chi-square p-value of the emitted token at each position reached by at least 100 of n sequences."""
    target_rows, draft_rows, params = distribution_case(name)
    k, vocab = draft_rows.shape
    g = torch.Generator().manual_seed(case_seed("draws", name, n))
    q = torch.stack([kept_probs(r, **params) for r in draft_rows])
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T.flatten()  # [n * k], sequence-major
    target = target_rows.repeat(n, 1)
    draft = draft_rows.repeat(n, 1)
    seeds = torch.randint(-(2**63), 2**63 - 1, (n * (k + 1),), generator=g)
    per_seq = {"temperature": torch.full((n,), params["temperature"]), "top_k": torch.full((n,), params["top_k"]),
               "top_p": torch.full((n,), params["top_p"]), "min_p": torch.full((n,), params["min_p"])}
    if path == "reference":
        out = reference_tokens(target, draft, drafts, [k] * n, per_seq, seeds)
    else:
        out = run(target, draft, drafts, [k] * n, per_seq, seeds, device).cpu()
    result = {}
    for j in range(k + 1):
        reached = out[:, j] >= 0
        if int(reached.sum()) >= 100:
            result[j] = chi_square_pvalue(out[reached, j], kept_probs(target_rows[j], **params))
    return result, out


@pytest.mark.parametrize("name", ["random", "draft_zeros", "one_hot", "p_equals_q", "processed"])
def test_reference_emits_tokens_distributed_as_the_target(name):
    pvalues, out = emitted_pvalues(name, 6000, "cpu", "reference")
    assert len(pvalues) >= 2 and min(pvalues.values()) > ALPHA, pvalues
    if name == "p_equals_q":
        assert bool((out >= 0).all()), "p = q must accept every draft and add the bonus token"


@pytest.mark.parametrize("name", ["random", "p_equals_q"])
def test_kernel_emits_tokens_distributed_as_the_target(name, device):
    n = 300 if interpreter_active() else 20000
    pvalues, out = emitted_pvalues(name, n, device, "kernel")
    assert 0 in pvalues and min(pvalues.values()) > ALPHA, pvalues
    if name == "p_equals_q":
        assert bool((out >= 0).all())


@triton.jit
def _residual_is_p(p, q):
    return p


def test_chi_square_fails_when_the_residual_is_p(device, monkeypatch):
    """The same check as above, with the rejected position drawing from p instead of max(0, p - q): the
    reference, and the interpreted kernel (a compiled kernel keeps its cached code), must fail it."""
    monkeypatch.setattr(spec, "_residual", lambda p, q: p)
    pvalues, _ = emitted_pvalues("random", 6000, "cpu", "reference")
    assert pvalues[0] < 1e-6, pvalues
    if interpreter_active():
        monkeypatch.setattr(spec_kernel, "_residual", _residual_is_p)
        pvalues, _ = emitted_pvalues("random", 300, device, "kernel")
        assert pvalues[0] < ALPHA, pvalues


def test_op_processing_matches_the_independent_definition():
    g = torch.Generator().manual_seed(case_seed("processing"))
    x = torch.randn(64, 23, generator=g) * 2
    x[::3, 5] = x[::3, 6]  # ties
    x[torch.rand(x.shape, generator=g) < 0.1] = NEG_INF
    x[7] = NEG_INF
    temperature = torch.where(torch.rand(64, generator=g) < 0.2, 0.0, 0.3 + torch.rand(64, generator=g))
    top_k = torch.randint(-1, 25, (64,), generator=g)
    top_p = torch.where(torch.rand(64, generator=g) < 0.5, torch.rand(64, generator=g).clamp_min(0.05), 1.0)
    min_p = torch.where(torch.rand(64, generator=g) < 0.5, 0.2 * torch.rand(64, generator=g), 0.0)
    got = spec.speculative_probs(x, temperature, top_k, top_p, min_p)
    want = torch.stack([kept_probs(x[i], float(temperature[i]), int(top_k[i]), float(top_p[i]), float(min_p[i]))
                        for i in range(64)])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)


# --- bad input -----------------------------------------------------------------------------------------
def _good():
    return {"target_logits": torch.randn(5, 10), "draft_token_ids": torch.tensor([1, 2, 3]),
            "num_draft_tokens": [2, 1], "temperature": 1.0, "seed": torch.arange(5),
            "draft_logits": torch.randn(3, 10)}


@pytest.mark.parametrize("change, error, pattern", [
    ({"target_logits": torch.randn(4, 10)}, ValueError, r"target_logits must have .* = 5 rows"),
    ({"target_logits": torch.randn(5, 10).long()}, TypeError, "target_logits must have dtype"),
    ({"draft_token_ids": torch.tensor([1, 2])}, ValueError, "draft_token_ids must have sum"),
    ({"draft_token_ids": torch.tensor([1, 2, 10])}, ValueError, r"draft_token_ids must be in \[0, 10\)"),
    ({"draft_token_ids": torch.tensor([1.0, 2.0, 3.0])}, TypeError, "draft_token_ids must have dtype"),
    ({"num_draft_tokens": torch.tensor([2, 1])}, TypeError, "num_draft_tokens must be a list of ints"),
    ({"num_draft_tokens": [2, 1, 17], "target_logits": torch.randn(23, 10)}, ValueError, "0..16"),
    ({"num_draft_tokens": []}, ValueError, "num_draft_tokens must name"),
    ({"seed": torch.arange(4)}, ValueError, "seed must have one key per target row"),
    ({"draft_logits": torch.randn(3, 11)}, ValueError, r"draft_logits must have shape \(3, 10\)"),
    ({"temperature": -1.0}, ValueError, "temperature must be"),
    ({"temperature": torch.ones(3)}, ValueError, r"temperature must have shape \(2,\)"),
    ({"top_p": 0.0}, ValueError, "top_p must be"),
    ({"top_k": 1.5}, TypeError, "top_k must be an integer"),
    ({"min_p": 1.5}, ValueError, r"min_p must be in \[0, 1\]"),
    ({"rule": "typical"}, ValueError, "rule must be one of"),
])
def test_bad_input_names_the_argument(change, error, pattern):
    args = {**_good(), **change}
    with pytest.raises(error, match=pattern):
        rejection_sample(args.pop("target_logits"), args.pop("draft_token_ids"), args.pop("num_draft_tokens"),
                         args.pop("temperature"), **args)


# --- generated code ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled():
    return compile_module("kernel_lab.ops.speculative_kernel")


def test_compiles_for_every_target_without_spills(compiled):
    names = check_no_spills(compiled)
    assert names == {"rejection_chunk4096", "rejection_chunk64"}


def test_sass_reads_the_row_in_vector_loads(compiled):
    for (name, target), result in compiled.items():
        if name == "rejection_chunk4096":
            assert "LDG.E.128" in result["sass"], (name, target)  # p and q chunks in 16-byte loads


# --- GPU-only checks -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 151936])
def test_gpu_large_vocabulary_matches_the_reference(vocab):
    num_draft = [4, 8, 1, 0, 6, 3, 5, 2]
    batch = random_batch(num_draft, vocab, case_seed("gpu", vocab), dtype=torch.bfloat16, draft_from_q=False)
    got = run(*batch[:3], num_draft, *batch[3:], torch.device("cuda"))
    assert torch.equal(got.cpu(), reference_tokens(*batch[:3], num_draft, *batch[3:]))

