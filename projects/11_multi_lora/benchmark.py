"""Project 11 benchmark: batched LoRA (shrink + expand) over a mixed batch, against the base projection.

    python projects/11_multi_lora/benchmark.py [--quick] [--out results]

One stacked q|k|v projection of a Llama-3-8B-sized layer (K 4096, slices 4096|1024|1024), rank 16, bf16, with
1, 4 and 16 distinct adapters in the batch:
- decode (BGMV, one adapter index per row, rows dealt round-robin over the adapters) at 1..256 rows;
- prefill (SGMV, the rows sorted into one segment per adapter) at 2048 rows.
Two numbers per case: GB/s = kernel_lab.ops.lora.bytes_moved (x once, each distinct adapter's A and B once, h
written and read in fp32, y read and written) over the median time, as % of the measured copy bandwidth; and the LoRA
step's cost over the base step, `add_lora` time / the base projection's `x @ W^T` (cuBLAS) time, in percent.
Weight sets are rotated so that consecutive calls do not find them in L2.

On a machine without a GPU the run is functional only (tiny shapes, the CPU path, nothing written): it also
prints the CPU path's per-adapter matmuls against gathering each row's A and B for one bmm, the alternative
an engine could take, so the choice can be re-checked on a quiet machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernel_lab.harness.bench import benchmark, benchmark_main, inputs_for_rotation  # noqa: E402
from kernel_lab.harness.results import ResultRecord  # noqa: E402
from kernel_lab.harness.testing import assert_close  # noqa: E402
from kernel_lab.ops.lora import _expand_cpu, _shrink_cpu, add_lora, bytes_moved, segments_of_runs  # noqa: E402

PROJECT = "11_multi_lora"
ADAPTER_COUNTS = (1, 4, 16)


def shapes(device: torch.device, quick: bool):
    """(K, slice widths, rank, decode row counts, prefill rows)."""
    if device.type != "cuda":
        return 64, (64, 16, 16), 16, [4], 32
    return 4096, (4096, 1024, 1024), 16, ([1, 64] if quick else [1, 16, 64, 256]), 2048


def torch_rows(y, x, lora_a, lora_b, scale, offsets, per_row):
    """The same projection in fp32 torch ops, one matmul per adapter (the CPU path's functions): the check."""
    out = y.clone()
    h = torch.zeros((x.shape[0], lora_a.shape[1] * lora_a.shape[2]), dtype=torch.float32, device=x.device)
    _shrink_cpu(x, lora_a, h, per_row, None)
    _expand_cpu(out, h, lora_b, scale, offsets, per_row, None)
    return out


def gathered_bmm(y, x, lora_a, lora_b, scale, offsets, per_row):
    """The alternative CPU path: each row gathers its adapter's A and B (index_select) for one bmm."""
    idx = per_row.long().clamp_min(0)
    S, R = lora_a.shape[1], lora_a.shape[2]
    a = lora_a.index_select(0, idx).reshape(idx.shape[0], S * R, -1).float()
    h = torch.bmm(a, x.float()[:, :, None])[:, :, 0] * scale[idx, None]
    keep = (per_row >= 0).to(torch.float32)[:, None]
    b = lora_b.index_select(0, idx).float()
    for s, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        delta = torch.bmm(b[:, lo:hi], h[:, s * R:(s + 1) * R, None])[:, :, 0]
        y[:, lo:hi] = (y[:, lo:hi].float() + keep * delta).to(y.dtype)
    return y


def run(device: torch.device, quick: bool, out: str | None, dtype=torch.bfloat16) -> list[ResultRecord]:
    on_gpu = device.type == "cuda"
    if not on_gpu:
        dtype = torch.float32  # the CPU engine's weights
        out = None  # a loaded VM's timings are not records
    K, widths, rank, decode_rows, prefill_rows = shapes(device, quick)
    N, S = sum(widths), len(widths)
    offsets = tuple([0] + [sum(widths[:i + 1]) for i in range(S)])
    b = torch.finfo(dtype).bits // 8
    g = torch.Generator(device=device)
    g.manual_seed(0)
    max_adapters = max(ADAPTER_COUNTS)
    weight_bytes = max_adapters * (S * rank * K + N * rank) * b
    sets = inputs_for_rotation(weight_bytes) if on_gpu else 1
    weights = [(torch.randn((max_adapters, S, rank, K), device=device, generator=g).to(dtype) * K ** -0.5,
                torch.randn((max_adapters, N, rank), device=device, generator=g).to(dtype) * rank ** -0.5)
               for _ in range(sets)]
    scale = torch.full((max_adapters,), 2.0, device=device)
    w_base = torch.randn((N, K), device=device, generator=g).to(dtype) * K ** -0.5
    label = "bf16" if dtype == torch.bfloat16 else "fp32"
    record = ResultRecord(PROJECT, "batched lora shrink+expand vs the base qkv projection", device,
                          f"q|k|v of K={K}, slices {widths}, rank {rank}, {label}; GB/s = bytes_moved over the median "
                          "time; lora_over_base_percent = add_lora time / x @ W^T time; weight sets rotated")
    checked = passed = 0
    cases = [("bgmv", rows) for rows in decode_rows] + [("sgmv", prefill_rows)]
    for layout, rows in cases:
        x = torch.randn((rows, K), device=device, generator=g).to(dtype)
        y = torch.randn((rows, N), device=device, generator=g).to(dtype)
        base = benchmark(lambda: x @ w_base.t(), device=device, name=f"base rows={rows}")
        for adapters in ADAPTER_COUNTS:
            per_row = (torch.arange(rows, device=device) % adapters).to(torch.int32)
            if layout == "sgmv":
                per_row = torch.sort(per_row).values
                kwargs = {"segments": segments_of_runs(per_row)}
            else:
                kwargs = {"row_adapters": per_row}
            segments = min(adapters, rows)  # weight reads from DRAM: once per distinct adapter (bytes_moved)
            a0, b0 = weights[0]
            checked += 1
            try:
                expected = torch_rows(y, x, a0, b0, scale, offsets, per_row)
                assert_close(add_lora(y.clone(), x, a0, b0, scale, offsets, **kwargs), expected.double(), dtype,
                             scale=4.0)
                passed += 1
            except AssertionError as exc:
                print(f"MISMATCH {layout} rows={rows} adapters={adapters}: {exc}")
            fns = [lambda a=a, bb=bb: add_lora(y, x, a, bb, scale, offsets, validate=False, **kwargs)
                   for a, bb in weights]
            t = benchmark(fns, device=device, name=f"lora {layout} rows={rows} adapters={adapters}")
            extra = {"layout": layout, "adapters": adapters,
                     "lora_over_base_percent": 100.0 * t.median_ms / base.median_ms}
            if not on_gpu and layout == "bgmv":
                alt = benchmark(lambda: gathered_bmm(y, x, a0, b0, scale, offsets, per_row), device=device)
                extra["cpu_gathered_bmm_us"] = alt.median_ms * 1e3
                print(f"CPU path rows={rows} adapters={adapters}: per-adapter matmuls {t.median_ms * 1e3:.0f} us, "
                      f"gathered bmm {alt.median_ms * 1e3:.0f} us (functional run, loaded machine)")
            record.add_case(f"{layout} rows={rows} adapters={adapters}",
                            shape={"rows": rows, "K": K, "N": N, "slices": S, "rank": rank, "adapters": adapters,
                                   "segments": segments},
                            dtype=label, timing=t, baselines={"base projection": base}, extra=extra,
                            nbytes=bytes_moved(rows, segments, K, N, rank, S, b))
    record.set_correctness(passed, checked)
    worst = max(record.record["cases"], key=lambda c: c["lora_over_base_percent"])
    record.set_headline(f"lora costs at most {worst['lora_over_base_percent']:.0f}% of the base projection "
                        f"({worst['name']})", lora_over_base_percent=worst["lora_over_base_percent"])
    record.emit(out)
    print(f"correctness vs the fp32 per-adapter torch path: {passed}/{checked}")
    return [record]


if __name__ == "__main__":
    raise SystemExit(benchmark_main(__doc__, run, no_grad=True))
