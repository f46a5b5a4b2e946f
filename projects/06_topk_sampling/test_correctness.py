"""Project 06 correctness: exact top-k and sampling from the renormalised top-k / top-p distribution.

On a machine without CUDA the Triton kernels run through the interpreter (see conftest.py), on small
vocabularies (plus cases with several tiles, so the merge runs); on a GPU the same tests run the compiled
kernels. The expected sets and distributions are computed here independently of kernel_lab (a stable
float64 sort), never with the op's own reference.

Statistical tests: sampled frequencies are compared with the exact renormalised distribution by a Pearson
chi-square goodness-of-fit test at significance ALPHA = 1e-3, i.e. a correct sampler fails one such test
once in a thousand seed choices (the seeds here are fixed, so a run is deterministic). Tokens outside the
kept set must never appear at all (a hard check, not a statistical one). `test_chi_square_detects_a_wrong
distribution` shows the test has the power to fail.
"""

from __future__ import annotations

import pytest
import torch

import kernel_lab.ops.sampling as sampling_mod
from kernel_lab.harness.compile import TARGETS, check_no_spills, compile_module
from kernel_lab.harness.testing import case_seed, chi_square_pvalue, randn
from kernel_lab.ops import sample, topk
from kernel_lab.ops.sampling import sample_plan, topk_plan

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ALPHA = 1e-3
NEG_INF = float("-inf")


# --- independent definitions ---------------------------------------------------------------------------
def stable_descending(x: torch.Tensor) -> torch.Tensor:
    """Indices of x sorted by value, descending, equal values in index order (NaN first)."""
    return torch.sort(x.double(), dim=-1, descending=True, stable=True).indices


def kept_distribution(x_row: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                      margin: float = 1e-4) -> torch.Tensor:
    """Exact float64 probabilities of sample() for one row (zero outside the kept set). Asserts that no
    cumulative mass lies within `margin` of the top-p cut, so float rounding cannot decide the test."""
    x = torch.nan_to_num(x_row.double(), nan=NEG_INF, posinf=torch.finfo(torch.float32).max)
    vocab = x.numel()
    order = stable_descending(x)
    n_rank = top_k if 0 < top_k < vocab else vocab
    e = torch.exp((x[order] - x.max()) / temperature)[:n_rank]
    n_keep = n_rank
    if top_p < 1.0:
        before = torch.cumsum(e, 0) - e
        limit = top_p * e.sum()
        assert bool(((before - limit).abs() > margin * e.sum()).all()), "top-p cut too close to a prefix sum"
        n_keep = max(1, int((before < limit).sum()))
    probs = torch.zeros(vocab, dtype=torch.float64)
    probs[order[:n_keep]] = e[:n_keep] / e[:n_keep].sum()
    return probs


def test_chi_square_survival_function_matches_tabulated_quantiles():
    # (statistic, degrees of freedom, survival probability) from standard chi-square tables
    for stat, dof, sf in [(3.841, 1, 0.05), (11.345, 3, 0.01), (20.515, 5, 0.001), (9.342, 10, 0.5)]:
        value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                              torch.tensor(stat / 2, dtype=torch.float64)))
        assert abs(value - sf) < 2e-3 * max(sf, 0.01), (stat, dof, value)


def chi_square_logits(dtype=torch.float32) -> torch.Tensor:
    """48 logits with exact ties (two 1.5s inside the top-k set, two 0.5s straddling a top-k cut),
    -inf entries, and a long tail, scattered over the row."""
    values = [2.0, 1.5, 1.5, 1.25, 1.0, 0.75, 0.5, 0.5, 0.25, 0.0, -0.25, -0.5]
    values += [-1.0 - 0.125 * i for i in range(30)] + [NEG_INF] * 6
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(6))
    x = torch.empty(48)
    x[perm] = torch.tensor(values)
    return x.to(dtype)


# --- top-k ---------------------------------------------------------------------------------------------
def logits_with_ties(shape, dtype, device, seed):
    """Values on a coarse grid (many exact ties, +0.0 and -0.0), some -inf, exactly representable in dtype."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-6, 7, shape, generator=g).float() * 0.5
    x = torch.where(torch.rand(shape, generator=g) < 0.5, x, torch.randn(shape, generator=g) * 3)
    x[torch.rand(shape, generator=g) < 0.05] = NEG_INF
    x[torch.rand(shape, generator=g) < 0.02] = -0.0
    return x.to(dtype).to(device)


def check_topk(x: torch.Tensor, k: int):
    values, indices = topk(x, k)
    assert values.dtype == x.dtype and indices.dtype == torch.int64
    assert values.shape == indices.shape == (x.shape[0], k)
    xc = x.cpu()
    assert torch.equal(values.cpu(), torch.topk(xc.float(), k).values.to(x.dtype)), "values differ from torch.topk"
    assert torch.equal(xc.gather(1, indices.cpu()), values.cpu()), "indices do not point at the values"
    assert torch.equal(indices.cpu(), stable_descending(xc)[:, :k]), "ties not broken towards the lowest index"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab, k", [(3, 1000, 5), (2, 333, 1), (2, 300, 300), (1, 4096 + 904, 37),
                                            (1, 1500, 1024)])
def test_topk_is_exact_with_ties_and_neg_inf(rows, vocab, k, dtype, device):
    check_topk(logits_with_ties((rows, vocab), dtype, device, case_seed("topk", rows, vocab, k, dtype)), k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_moved_is_the_logits_read_and_the_outputs_written(dtype, device):
    """Against the nbytes of the tensors a call reads and returns (the per-row parameters in the dtypes
    the kernels take), so a count that drops or doubles a stream fails."""
    rows, vocab, k = 3, 700, 9
    x = randn((rows, vocab), dtype, device, case_seed("bytes", dtype))
    values, indices = topk(x, k)
    assert sampling_mod.topk_bytes_moved(rows, vocab, k, x.element_size()) == x.nbytes + values.nbytes + indices.nbytes
    params = [torch.full((rows,), 0.7, device=device), torch.full((rows,), 5, dtype=torch.int32, device=device),
              torch.full((rows,), 0.9, device=device), torch.arange(rows, device=device)]
    token = sample(x, *params)
    assert sampling_mod.sample_bytes_moved(rows, vocab, x.element_size()) == (
        x.nbytes + sum(p.nbytes for p in params) + token.nbytes)


def test_topk_several_tiles_reach_the_merge(device):
    plan = topk_plan(4096 + 904, 37)
    assert plan["n_tiles"] >= 2, "this case must merge the candidates of several tiles"
    check_topk(randn((2, 4096 + 904), torch.bfloat16, device, 5, scale=2.0), 37)


@pytest.mark.parametrize("k", [40, 200])
def test_topk_multi_level_merge(k, device, monkeypatch):
    # Smaller tiles and merge blocks than production, so a small vocabulary needs several merge levels.
    monkeypatch.setattr(sampling_mod, "MAX_TILE", 256)
    monkeypatch.setattr(sampling_mod, "MERGE_BLOCK", 512)
    plan = topk_plan(3000, k)
    assert plan["n_tiles"] > plan["group"], "the case must need more than one merge level"
    check_topk(logits_with_ties((2, 3000), torch.float32, device, case_seed("levels", k)), k)


def test_topk_nan_ranks_first_like_torch(device):
    x = randn((2, 100), torch.float32, device, 9)
    x[0, 17] = float("nan")
    x[1, 3] = float("inf")
    values, indices = topk(x, 4)
    assert int(indices[0, 0]) == 17 and torch.isnan(values[0, 0])
    assert int(indices[1, 0]) == 3
    ref = torch.topk(x.cpu(), 4)
    assert torch.equal(values[:, 1:].cpu(), ref.values[:, 1:])


def test_topk_strided_rows_and_columns(device):
    base = randn((4, 700), torch.float16, device, 11)
    check_topk(base[::2, 50:650], 9)  # row stride 1400, unit column stride: no copy
    check_topk(randn((600, 3), torch.float16, device, 12).t(), 9)  # column stride 3: copied


def test_topk_zero_rows(device):
    values, indices = topk(torch.empty((0, 50), device=device), 3)
    assert values.shape == indices.shape == (0, 3)


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda d: topk(torch.ones(2, 10, device=d), 0), ValueError, "k must be in"),
        (lambda d: topk(torch.ones(2, 10, device=d), 11), ValueError, "k must be in"),
        (lambda d: topk(torch.ones(1, 2000, device=d), 1025), ValueError, "k must be in"),
        (lambda d: topk(torch.ones(2, 10, device=d), 2.0), TypeError, "k must be an int"),
        (lambda d: topk(torch.ones(2, 10, device=d), True), TypeError, "k must be an int"),
        (lambda d: topk(torch.ones(10, device=d), 1), ValueError, "logits must be 2-D"),
        (lambda d: topk(torch.ones(2, 10, dtype=torch.int32, device=d), 1), TypeError, "logits must have dtype"),
        (lambda d: topk(torch.empty(1, 262145, device=d), 1), ValueError, "vocabulary"),
        (lambda d: topk([[1.0, 2.0]], 1), TypeError, "logits must be a torch.Tensor"),
    ],
)
def test_topk_bad_input(call, error, pattern, device):
    with pytest.raises(error, match=pattern):
        call(device)


# --- sampling: exactness of the kept set and the distribution ------------------------------------------
def draw_many(x_row, n, device, temperature, top_k=None, top_p=None, first_seed=0):
    rows = x_row.to(device).expand(n, -1)
    args = dict(seed=torch.arange(first_seed, first_seed + n, device=device))
    if top_k is not None:
        args["top_k"] = torch.full((n,), top_k, dtype=torch.int64, device=device)
    if top_p is not None:
        args["top_p"] = torch.full((n,), top_p, dtype=torch.float32, device=device)
    return sample(rows, torch.full((n,), temperature, device=device), **args)


CHI_CASES = [  # (temperature, top_k, top_p): plain, top-k (tie at the cut), top-p alone, both
    (0.9, None, None),
    (1.0, 7, None),
    (0.8, None, 0.6),
    (1.2, 10, 0.7),
]
# Under the interpreter a row costs ~40 ms, so CPU runs draw 64 samples for the three truncating cases (plain
# sampling is pinned to the others by test_the_three_paths_share_one_noise_stream); GPU runs draw 100000.
CPU_CHI_SAMPLES = 64


@pytest.mark.parametrize("temperature, top_k, top_p", CHI_CASES)
def test_sampled_frequencies_fit_the_exact_distribution(temperature, top_k, top_p, device):
    if device.type == "cpu" and top_k is None and top_p is None:
        pytest.skip("interpreter budget: plain sampling is checked on the GPU and via the three-paths test")
    x = chi_square_logits(torch.bfloat16 if top_k == 7 else torch.float32)
    n = CPU_CHI_SAMPLES if device.type == "cpu" else 100_000
    tokens = draw_many(x, n, device, temperature, top_k, top_p, first_seed=case_seed("chi", temperature))
    probs = kept_distribution(x, temperature, top_k or 0, top_p or 1.0)
    assert chi_square_pvalue(tokens, probs) > ALPHA


def test_reference_path_fits_the_exact_distribution(reference_only):
    x = chi_square_logits()
    for temperature, top_k, top_p in CHI_CASES:
        tokens = draw_many(x, 20_000, "cpu", temperature, top_k, top_p, first_seed=case_seed("ref-chi", top_k))
        probs = kept_distribution(x, temperature, top_k or 0, top_p or 1.0)
        assert chi_square_pvalue(tokens, probs) > ALPHA, (temperature, top_k, top_p)


def test_chi_square_detects_a_wrong_distribution(reference_only):
    """Power check: 20000 draws at temperature 1.0 must fail against the temperature-0.8 expectation, and
    draws with top_k = 8 must fail against top_k = 7 (they hit a token outside the expected set)."""
    x = chi_square_logits()
    tokens = draw_many(x, 20_000, "cpu", 1.0)
    assert chi_square_pvalue(tokens, kept_distribution(x, 0.8)) < ALPHA
    tokens = draw_many(x, 2_000, "cpu", 1.0, top_k=8)
    with pytest.raises(AssertionError, match="outside the kept set"):
        chi_square_pvalue(tokens, kept_distribution(x, 1.0, 7))


def test_top_k_above_the_candidate_slot_takes_the_exact_streaming_path(device):
    """top_k > SAMPLE_SLOT with top_p: the kernel streams the row (top-k mass by bisection, then rejection
    rounds). Ten strong logits among 1100; the kept set is decided by top_p within the top 1050."""
    vocab = 1100
    assert 1050 > sample_plan(vocab)["slot"]
    x = randn((vocab,), torch.float32, "cpu", 21, scale=0.5) - 12.0
    strong = torch.randperm(vocab, generator=torch.Generator().manual_seed(2))[:10]
    x[strong] = torch.linspace(3.0, 1.0, 10)
    n = 8 if device.type == "cpu" else 20_000
    tokens = draw_many(x, n, device, 1.0, top_k=1050, top_p=0.75)
    probs = kept_distribution(x, 1.0, 1050, 0.75)
    assert bool((probs[tokens.cpu()] > 0).all()), "a token outside the kept set was drawn"
    if device.type == "cuda":
        assert chi_square_pvalue(tokens, probs) > ALPHA


def test_the_three_paths_share_one_noise_stream(device):
    """Twenty finite logits, the rest -inf: plain sampling (tile path), top_k = 20 (candidate path) and
    top_p = 0.999999 (rejection path) keep the same twenty tokens, so Gumbel-max must pick the same one
    for every seed: this pins the tile kernel's four-at-a-time Philox layout to the per-token one."""
    vocab, n = 256, 16 if device.type == "cpu" else 4096
    x = torch.full((vocab,), NEG_INF)
    finite = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))[:20]
    x[finite] = torch.randn(20, generator=torch.Generator().manual_seed(4)) * 0.5
    plain = draw_many(x, n, device, 0.7)
    by_k = draw_many(x, n, device, 0.7, top_k=20)
    by_p = draw_many(x, n, device, 0.7, top_p=0.999999)
    assert torch.equal(plain, by_k) and torch.equal(plain, by_p)
    assert len(set(plain.tolist())) > 4, "the draws should vary with the seed"
    assert set(plain.tolist()) <= set(finite.tolist())


# --- sampling: determinism, greedy, edges ----------------------------------------------------------------
def mixed_batch(device, vocab=5000):
    rows = 6
    x = randn((rows, vocab), torch.bfloat16, device, case_seed("mixed", vocab), scale=2.0)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3, 0.9, 1.0], device=device)
    top_k = torch.tensor([0, 5, 40, -1, 3, 1], device=device)
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.8, 1.0, 0.3], device=device)
    seed = torch.tensor([11, 12, 13, 14, 15, 2**40 + 7], device=device)
    return x, temperature, top_k, top_p, seed


def test_same_seed_same_token_whatever_the_batch(device):
    x, temperature, top_k, top_p, seed = mixed_batch(device)
    assert sample_plan(x.shape[1])["n_tiles"] >= 2
    full = sample(x, temperature, top_k, top_p, seed)
    assert torch.equal(full, sample(x, temperature, top_k, top_p, seed)), "not reproducible"
    for r in range(x.shape[0]):  # several tiles: the candidates went through supersets and a merge
        probs = kept_distribution(x[r].cpu(), float(temperature[r]) or 1.0, int(top_k[r]), float(top_p[r]),
                                  margin=0.0)
        assert probs[full[r].cpu()] > 0, (r, int(full[r]))
    order = torch.tensor([4, 0, 5, 2, 2, 1, 3], device=device)
    shuffled = sample(x[order], temperature[order], top_k[order], top_p[order], seed[order])
    assert torch.equal(shuffled, full[order]), "a row's token depends on the batch composition"
    alone = sample(x[2:3], temperature[2:3], top_k[2:3], top_p[2:3], seed[2:3])
    assert int(alone) == int(full[2])


def test_reference_same_seed_same_token_whatever_the_batch(reference_only):
    x, temperature, top_k, top_p, seed = mixed_batch("cpu")
    full = sample(x, temperature, top_k, top_p, seed)
    order = torch.tensor([4, 0, 5, 2, 2, 1, 3])
    assert torch.equal(sample(x[order], temperature[order], top_k[order], top_p[order], seed[order]), full[order])


def test_different_seeds_give_different_tokens(device):
    x = torch.zeros(1, 1000)  # uniform: 32 draws must not collapse onto a few tokens
    tokens = draw_many(x[0], 32, device, 1.0)
    assert len(set(tokens.tolist())) > 24


def test_greedy_is_argmax_lowest_index_on_ties(device):
    g = torch.Generator().manual_seed(8)
    x = torch.randint(-3, 4, (5, 3000), generator=g).float()  # every row's max is tied many times
    x[1, :] = NEG_INF
    x[2, 2999] = 10.0
    rows = x.shape[0]
    tokens = sample(x.to(device), torch.zeros(rows, device=device), top_k=torch.full((rows,), 3, device=device),
                    top_p=torch.full((rows,), 0.5, device=device), seed=torch.arange(rows, device=device))
    assert torch.equal(tokens.cpu(), torch.argmax(x, dim=1))
    assert int(tokens[1]) == 0 and int(tokens[2]) == 2999


def test_top_k_one_and_tiny_top_p_are_greedy(device):
    x = randn((4, 900), torch.float16, device, 31, scale=2.0)
    expected = torch.argmax(x.cpu().float(), dim=1)
    rows = torch.arange(4, device=device)
    temperature = torch.full((4,), 1.5, device=device)
    assert torch.equal(sample(x, temperature, top_k=torch.ones(4, dtype=torch.int32, device=device),
                              seed=rows).cpu(), expected)
    assert torch.equal(sample(x, temperature, top_p=torch.full((4,), 1e-6, device=device), seed=rows).cpu(),
                       expected)


def test_neg_inf_tokens_are_never_drawn(device):
    x = torch.full((16, 700), NEG_INF)
    x[:, 100:110] = torch.randn(10)
    x[:, 600] = 0.5
    tokens = sample(x.to(device), torch.full((16,), 5.0, device=device), seed=torch.arange(16, device=device))
    assert bool(((tokens >= 100) & (tokens < 110) | (tokens == 600)).all())
    all_neg_inf = torch.full((2, 50), NEG_INF, device=device)
    assert sample(all_neg_inf, torch.ones(2, device=device), seed=torch.arange(2, device=device)).tolist() == [0, 0]


def test_vocab_of_one_and_zero_rows(device):
    assert sample(torch.randn(3, 1, device=device), 1.0, seed=5).tolist() == [0, 0, 0]
    assert sample(torch.randn(0, 7, device=device), torch.ones(0, device=device)).shape == (0,)


def test_seed_none_draws_from_torch_generator(device):
    x = torch.zeros(8, 500, device=device)
    torch.manual_seed(123)
    a = sample(x, 1.0)
    torch.manual_seed(123)
    b = sample(x, 1.0)
    assert torch.equal(a, b) and a.dtype == torch.int64 and bool(((a >= 0) & (a < 500)).all())


def test_numbers_broadcast_to_every_row(device):
    x = randn((3, 200), torch.float32, device, 41)
    by_number = sample(x, 0.8, top_k=20, top_p=0.9, seed=77)
    by_tensor = sample(x, torch.full((3,), 0.8, device=device), top_k=torch.full((3,), 20, device=device),
                       top_p=torch.full((3,), 0.9, device=device), seed=torch.full((3,), 77, device=device))
    assert torch.equal(by_number, by_tensor)


def t(d, *values, dtype=None):
    return torch.tensor(values, device=d, dtype=dtype)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(temperature=[1.0, 1.0]), TypeError, "temperature must be"),
        (dict(temperature="t3"), ValueError, r"temperature must have shape \(2,\)"),
        (dict(temperature="int"), TypeError, "temperature must have dtype"),
        (dict(temperature="neg"), ValueError, "temperature must be finite and >= 0"),
        (dict(temperature="nan"), ValueError, "temperature must be finite and >= 0"),
        (dict(top_k="float"), TypeError, "top_k must have dtype"),
        (dict(top_k="k-2"), ValueError, "top_k must be >= -1"),
        (dict(top_k="k2d"), ValueError, "top_k must be 1-D"),
        (dict(top_k=1.5), TypeError, "top_k must be an integer"),
        (dict(top_p="p0"), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_p="p1.5"), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_p="pnan"), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(seed="float"), TypeError, "seed must have dtype"),
        (dict(seed="s3"), ValueError, r"seed must have shape \(2,\)"),
        (dict(seed=True), TypeError, "seed must be"),
    ],
)
def test_sample_bad_input(kwargs, error, pattern):
    d = "cpu"  # values are checked where they can be read without a device sync
    named = {
        "t3": t(d, 1.0, 1.0, 1.0), "int": t(d, 1, 1), "neg": t(d, 1.0, -0.5), "nan": t(d, 1.0, float("nan")),
        "float": t(d, 1.0, 2.0), "k-2": t(d, 3, -2), "k2d": t(d, [1, 2]), "p0": t(d, 0.0, 0.5),
        "p1.5": t(d, 1.5, 0.5), "pnan": t(d, float("nan"), 0.5), "s3": t(d, 1, 2, 3),
    }
    args = {"temperature": t(d, 1.0, 1.0)}
    args.update({k: named.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()})
    with pytest.raises(error, match=pattern):
        sample(torch.randn(2, 10), **args)


def test_sample_bad_logits():
    with pytest.raises(ValueError, match="logits must be 2-D"):
        sample(torch.randn(2, 3, 4), 1.0)
    with pytest.raises(TypeError, match="logits must have dtype"):
        sample(torch.ones(2, 4, dtype=torch.int64), 1.0)


def test_mixed_devices_rejected():
    if not torch.cuda.is_available():
        pytest.skip("needs two devices")  # pragma: no cover
    with pytest.raises(ValueError, match="share a device"):
        sample(torch.randn(2, 10, device="cuda"), torch.ones(2))


def test_reference_path_is_fast_enough_for_the_engine(reference_only):
    """The engine samples on CPU every decode step: 8 rows of a 49152-token vocabulary, LLM-like logits
    (a few dominant tokens), a mix of greedy, top-k and top-p rows. CPU time, generously bounded: this
    catches an accidental per-token Python loop or full-vocabulary sort per row, not jitter."""
    import time

    x = randn((8, 49152), torch.float32, "cpu", 51, scale=2.0)
    x[:, :40] += torch.linspace(12.0, 6.0, 40)
    args = dict(top_k=torch.tensor([0, 50, 0, 20, 0, 0, 100, 0]), top_p=torch.tensor([1.0, 0.9, 0.95, 1.0] * 2),
                seed=torch.arange(8))
    temperature = torch.tensor([0.7, 0.7, 1.0, 0.0, 0.8, 0.7, 1.2, 0.0])
    sample(x, temperature, **args)
    start = time.process_time()
    for _ in range(3):
        sample(x, temperature, **args)
    assert (time.process_time() - start) / 3 < 1.0


# --- generated code ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled():
    return compile_module("kernel_lab.ops.sampling", targets=TARGETS)


def test_compiles_for_every_target_without_spills(compiled):
    kernels = {"topk_tile_bf16", "sample_tile_bf16", "sample_finish_bf16", "merge_slot1024", "topk_finish_k1024"}
    for target in ("sm_80", "sm_89", "sm_90a"):
        assert kernels <= {name for name, t in compiled if t == target}, target
    check_no_spills(compiled, targets=None)  # some variants build for one target only


def test_sass_has_vector_loads_and_fast_exponentials(compiled):
    for (name, target), result in compiled.items():
        sass = result["sass"]
        if name.startswith(("topk_tile", "sample_tile")) and not name.endswith("_v48"):
            assert "LDG.E.128" in sass, (name, target)  # the logits tile is read with 16-byte loads
        if name.startswith(("sample_tile", "sample_finish")):
            assert "MUFU.EX2" in sass, (name, target)  # tl.exp lowers to ex2.approx, not a libdevice call


# --- GPU-only checks -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("rows, vocab, k, dtype", [
    (64, 32000, 1, torch.float32), (64, 32000, 50, torch.bfloat16), (64, 32000, 1024, torch.float16),
    (16, 151936, 1, torch.bfloat16), (16, 151936, 50, torch.float16), (16, 151936, 1024, torch.float32),
    (8, 262144, 1, torch.float16), (8, 262144, 50, torch.float32), (8, 262144, 1024, torch.bfloat16),
    (300, 8192, 64, torch.bfloat16),
])
def test_gpu_topk_large_vocabularies(rows, vocab, k, dtype):
    check_topk(logits_with_ties((rows, vocab), dtype, "cuda", case_seed("gpu-topk", rows, vocab, k)), k)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 151936, 262144])
def test_gpu_sampled_token_is_in_the_kept_set(vocab):
    rows = 64
    x = randn((rows, vocab), torch.bfloat16, "cuda", case_seed("gpu-kept", vocab), scale=3.0)
    temperature = torch.rand(rows, device="cuda") + 0.3
    top_k = torch.tensor([0, 1, 50, 1024, 2000, -1, 20, 0] * 8, device="cuda")
    top_p = torch.tensor([0.9, 1.0, 0.95, 0.5, 0.8, 1.0, 1.0, 0.99] * 8, device="cuda")
    tokens = sample(x, temperature, top_k, top_p, torch.arange(rows, device="cuda")).cpu()
    for r in range(rows):
        probs = kept_distribution(x[r].cpu().float(), float(temperature[r]), int(top_k[r]), float(top_p[r]),
                                  margin=0.0)
        assert probs[tokens[r]] > 0, (r, int(tokens[r]))


@pytest.mark.gpu
def test_gpu_under_cuda_graph():
    rows, vocab = 32, 131072
    x = randn((rows, vocab), torch.bfloat16, "cuda", 5, scale=3.0)
    temperature = torch.full((rows,), 0.8, device="cuda")
    top_k = torch.tensor([0, 50] * 16, device="cuda")
    top_p = torch.tensor([0.9, 1.0, 0.95, 0.8] * 8, device="cuda")
    seed = torch.arange(rows, device="cuda")
    eager = sample(x, temperature, top_k, top_p, seed)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sample(x, temperature, top_k, top_p, seed)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sample(x, temperature, top_k, top_p, seed)
    captured.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    seed.add_(1000)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, sample(x, temperature, top_k, top_p, seed))
