"""Project 10 benchmark: the cost of verifying a speculative step (`ops.rejection_sample`), and the acceptance
each rule gets on synthetic target/draft pairs.

    python projects/10_speculative/benchmark.py [--quick] [--out results]

`verify`: one call for B sequences with k = 4 drafts each (B * 5 target rows, B * 4 draft rows of bf16
logits, randn * 2; the draft is the target plus noise), both rules, plain temperature and top-k 50 + top-p
0.9. Baseline: `ops.sample` over the B rows a non-speculative step samples (what the step spends on sampling
without speculation). On the GPU every call is timed with CUDA events (the op's processing allocates and
sorts, so it is not graph-captured here); on the CPU it is the float64 torch path (`rejection_reference`),
wall clock.

`acceptance`: 1000 sequences of k = 4 per pair, target randn * 2 over 1024 tokens, draft = target + noise of
standard deviation sigma, temperature 1. Reported per pair: the fraction of drafts accepted before the
first rejection and the acceptance at the first position, for each rule, and 1 - TV(p, q), the standard
rule's expected acceptance at each position.
- `rejection`: drafts drawn from q with independent randomness (a draft model that samples on its own);
- `coupled`: the draft samples with the target's keys (`ops.sample` on the draft logits, same seeds), so
  the draft is accepted iff both draws agree. How often they agree depends on the draw's coupling, which is
  the device's `ops.sample` path: on the CPU the inverse CDF in index order with one uniform per key; on the
  GPU the exponential race with one Philox variate per (key, token). The CPU run measures its own path and
  the race (computed with the CPU mirror of the GPU's Philox words, keyed_random.py: the same tokens the GPU
  draws for plain temperature sampling).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernel_lab.harness.bench import benchmark, benchmark_main, summarize  # noqa: E402
from kernel_lab.harness.results import ResultRecord  # noqa: E402
from kernel_lab.ops import rejection_sample, sample  # noqa: E402
from kernel_lab.ops.keyed_random import race_exponentials  # noqa: E402
from kernel_lab.ops.speculative import speculative_probs  # noqa: E402

PROJECT = "10_speculative"
K = 4
CONFIGS = {"plain": (0.8, 0, 1.0), "k50p0.9": (0.8, 50, 0.9)}  # name: (temperature, top_k, top_p)


def verify_inputs(batch: int, vocab: int, device, gen):
    target = torch.randn(batch * (K + 1), vocab, generator=gen) * 2
    rows = [b * (K + 1) + i for b in range(batch) for i in range(K)]
    draft = target[rows] + torch.randn(batch * K, vocab, generator=gen)
    drafts = torch.randint(0, vocab, (batch * K,), generator=gen)
    seeds = torch.randint(0, 2**62, (batch * (K + 1),), generator=gen)
    return (target.to(device, torch.bfloat16), draft.to(device, torch.bfloat16), drafts.to(device),
            seeds.to(device))


def timed(fn, device, label):
    return benchmark(fn, device=device, cuda_graph=False, rep=30, name=label)


def verify_record(device, vocabs, batches) -> ResultRecord:
    record = ResultRecord(PROJECT, "verify", device,
                          f"rejection_sample(): B sequences x k={K} drafts, bf16 logits randn*2 (draft = target + "
                          "noise); both rules; baseline ops.sample over the B rows a step without speculation "
                          "samples; CPU: the float64 torch path", ceilings_record={})
    gen = torch.Generator().manual_seed(0)
    for vocab in vocabs:
        for batch in batches:
            target, draft, drafts, seeds = verify_inputs(batch, vocab, device, gen)
            plain_rows = target[K::K + 1]
            for cname, (temp, top_k, top_p) in CONFIGS.items():
                params = {"top_k": top_k, "top_p": top_p}
                label = f"{cname} batch={batch} vocab={vocab}"
                base = timed(lambda: sample(plain_rows, temp, top_k=torch.full((batch,), top_k, device=device),
                                            top_p=torch.full((batch,), top_p, device=device),
                                            seed=seeds[:batch]), device, f"ops.sample {label}")
                for rule in ("rejection", "coupled"):
                    t = timed(lambda rule=rule: rejection_sample(target, drafts, [K] * batch, temp, seed=seeds,
                                                                 draft_logits=draft, rule=rule, **params),
                              device, f"{rule} {label}")
                    record.add_case(f"{rule} {label}", shape={"batch": batch, "vocab": vocab, "k": K,
                                                              "config": cname, "rule": rule},
                                    dtype="bf16", timing=t, baselines={"ops.sample (no speculation)": base})
    return record


def _acceptance(accepted: torch.Tensor) -> dict:
    """From [sequences, k] draft-equals-emitted flags: the mean fraction of the k drafts accepted before the
    first rejection, and the acceptance rate at the first position (comparable with 1 - TV there)."""
    run = torch.cumprod(accepted.long(), dim=1).sum(dim=1).double()
    return {"accepted_fraction": float(run.mean()) / accepted.shape[1],
            "first_position": float(accepted[:, 0].double().mean())}


def acceptance_record(device, sigmas, n: int = 1000, vocab: int = 1024) -> ResultRecord:
    record = ResultRecord(PROJECT, "acceptance", device,
                          f"acceptance on synthetic pairs: {n} sequences x k={K}, vocab {vocab}, target randn*2, "
                          "draft = target + sigma * noise, temperature 1; accepted fraction of drafts before "
                          "the first rejection", ceilings_record={})
    gen = torch.Generator().manual_seed(1)
    for sigma in sigmas:
        base = torch.randn(K + 1, vocab, generator=gen) * 2
        draft_rows = base[:K] + sigma * torch.randn(K, vocab, generator=gen)
        target = base.repeat(n, 1).to(device)
        draft = draft_rows.repeat(n, 1).to(device)
        seeds = torch.randint(0, 2**62, (n * (K + 1),), generator=gen).to(device)
        draft_seeds = seeds.reshape(n, K + 1)[:, :K].flatten()
        p = speculative_probs(base[:K], torch.ones(K))
        q = speculative_probs(draft_rows, torch.ones(K))
        tv = 0.5 * (p - q).abs().sum(dim=1)
        result = {"one_minus_tv": (1 - tv).tolist()}
        start = time.perf_counter()
        independent = torch.multinomial(q, n, replacement=True, generator=gen).T.flatten().to(device)
        out = rejection_sample(target, independent, [K] * n, 1.0, seed=seeds, draft_logits=draft)
        result["rejection"] = _acceptance(out[:, :K].cpu() == independent.cpu().reshape(n, K))
        keyed = sample(draft, 1.0, seed=draft_seeds)
        out = rejection_sample(target, keyed, [K] * n, 1.0, seed=seeds, draft_logits=draft, rule="coupled")
        result[f"coupled ({device.type} ops.sample)"] = _acceptance(out[:, :K].cpu() == keyed.cpu().reshape(n, K))
        if device.type == "cpu":  # the GPU's coupling, from the same Philox words it draws
            e = race_exponentials(draft_seeds, vocab)
            rows = torch.arange(K).repeat(n)
            same = torch.argmax(q[rows] / e, dim=1) == torch.argmax(p[rows] / e, dim=1)
            result["coupled (exponential race, the GPU's draw)"] = _acceptance(same.reshape(n, K))
        elapsed = (time.perf_counter() - start) * 1e3
        record.add_case(f"acceptance sigma={sigma}", shape={"sequences": n, "k": K, "vocab": vocab, "sigma": sigma},
                        dtype="fp32", timing=summarize([elapsed], {"timer": "one pass, wall clock"}),
                        extra={"acceptance": result})
        print(f"sigma={sigma}: {result}")
    return record


def run(device: torch.device, quick: bool, out: str | None) -> list[ResultRecord]:
    if device.type == "cuda":
        vocabs, batches = ([151936], [1, 64]) if quick else ([32000, 151936], [1, 16, 64, 256])
    else:
        vocabs, batches = [49152], [1]
    records = [verify_record(device, vocabs, batches), acceptance_record(device, [0.5, 1.0, 2.0])]
    for rec in records:
        rec.emit(out)
    return records


if __name__ == "__main__":
    raise SystemExit(benchmark_main(__doc__, run, no_grad=True))
