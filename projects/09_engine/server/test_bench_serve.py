"""`kernel-lab bench serve` against a fake-engine server: workload shapes, arrival process, metric
arithmetic, the record, the CLI path and the plots drawn from records."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from kernel_lab.bench import plots
from kernel_lab.bench import serve as bench_serve
from kernel_lab.bench.serve import (
    BenchRequest,
    RequestResult,
    _percentile,
    arrival_delays,
    build_workload,
    run_benchmark,
    summarize,
)


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    # a word-level tokenizer: exact lengths are easy to reason about
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(500)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    from kernel_lab.models.tokenizer import Tokenizer as EngineTokenizer

    return EngineTokenizer(tok)


def test_fixed_and_random_workloads_have_the_lengths_asked_for(tokenizer):
    fixed = build_workload(
        tokenizer, dataset="fixed", num_prompts=20, input_len=17, output_len=5, range_ratio=0.5, seed=1
    )
    assert all(r.prompt_len == 17 and r.output_len == 5 for r in fixed)
    assert all(len(tokenizer.encode(r.prompt, add_special_tokens=False)) == 17 for r in fixed)
    rnd = build_workload(
        tokenizer, dataset="random", num_prompts=200, input_len=20, output_len=10, range_ratio=0.5, seed=2
    )
    ins, outs = [r.prompt_len for r in rnd], [r.output_len for r in rnd]
    assert min(ins) >= 10 and max(ins) <= 30 and len(set(ins)) > 5
    assert min(outs) >= 5 and max(outs) <= 15 and len(set(outs)) > 3
    again = build_workload(
        tokenizer, dataset="random", num_prompts=200, input_len=20, output_len=10, range_ratio=0.5, seed=2
    )
    assert [r.prompt for r in again] == [r.prompt for r in rnd]
    with pytest.raises(ValueError, match="range_ratio"):
        build_workload(tokenizer, dataset="random", num_prompts=1, input_len=4, output_len=4, range_ratio=1.5, seed=0)


def test_poisson_arrivals_have_the_requested_rate():
    gaps = arrival_delays(4000, request_rate=8.0, burstiness=1.0, seed=3)
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(1 / 8, rel=0.06)
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    assert var == pytest.approx(mean**2, rel=0.15)  # exponential: variance = mean^2
    assert arrival_delays(5, float("inf"), 1.0, 0) == [0.0] * 5


def test_summary_arithmetic():
    results = [
        RequestResult(True, prompt_len=10, output_tokens=5, ttft_s=0.1, e2el_s=0.5, itl_s=[0.1] * 4),
        RequestResult(True, prompt_len=20, output_tokens=1, ttft_s=0.3, e2el_s=0.3, itl_s=[]),
        RequestResult(False, error="HTTP 500"),
    ]
    m = summarize(results, duration_s=2.0)
    assert m["completed"] == 2 and m["failed"] == 1 and m["errors"] == ["HTTP 500"]
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 3.0 and m["total_token_throughput"] == 18
    assert m["ttft_ms"]["mean"] == pytest.approx(200) and m["ttft_ms"]["median"] == pytest.approx(200)
    assert m["tpot_ms"]["count"] == 1 and m["tpot_ms"]["mean"] == pytest.approx(100)  # (0.5 - 0.1) / 4
    assert m["itl_ms"]["count"] == 4 and m["itl_ms"]["p99"] == pytest.approx(100)
    values = [random.Random(0).random() for _ in range(101)]
    assert _percentile(values, 90) == sorted(values)[90]


def test_benchmark_against_fake_server_matches_server_metrics(fake_server, read_metrics):
    server = fake_server(step_delay_s=0.002)
    requests = [BenchRequest(prompt="w1 w2 w3", prompt_len=3, output_len=4 + i % 3) for i in range(12)]
    model = server.client().models.list().data[0].id
    for endpoint in ("/v1/completions", "/v1/chat/completions"):
        results, duration = asyncio.run(
            run_benchmark(
                server.url,
                endpoint,
                model,
                requests,
                request_rate=float("inf"),
                burstiness=1.0,
                max_concurrency=4,
                seed=0,
                ignore_eos=True,
                api_key=None,
                timeout_s=30,
            )
        )
        assert duration > 0 and all(r.success for r in results), [r.error for r in results]
        assert [r.output_tokens for r in results] == [q.output_len for q in requests]
        for r in results:
            assert 0 < r.ttft_s <= r.e2el_s and all(gap >= 0 for gap in r.itl_s)
    server.wait_idle()
    values = read_metrics(server.url)
    assert values[("kernel_lab_request_generation_tokens_total", ())] == 2 * sum(q.output_len for q in requests)


def test_cli_writes_records_and_plots_draw_them(fake_server, tmp_path, monkeypatch, tokenizer, capsys):
    server = fake_server(step_delay_s=0.001)
    monkeypatch.setattr(bench_serve, "load_tokenizer", lambda spec: tokenizer)
    # the full environment record runs nvcc and git (tens of seconds on a busy machine); tested elsewhere
    import kernel_lab.harness.env as env_module

    monkeypatch.setattr(
        env_module,
        "environment_record",
        lambda: {"date": "2026-01-01T00:00:00+00:00", "gpu": None, "cpu": "test-cpu", "cpu_count": 2,
                 "torch": "test", "python": "3"},
    )
    from kernel_lab.cli import main

    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--dataset-name",
            "fixed",
            "--input-len",
            "8",
            "--output-len",
            "6",
            "--num-prompts",
            "8",
            "--max-concurrency",
            "1,4",
            "--server-label",
            "fake",
            "--result-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Median TTFT (ms)" in out
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 2
    record = json.loads(files[0].read_text())
    assert_harness_record(record)
    serve = record["serve"]
    assert serve["metrics"]["completed"] == 8 and serve["metrics"]["total_output_tokens"] == 48
    assert serve["device"].startswith("CPU") and serve["max_concurrency"] == 1
    assert [c["name"] for c in record["cases"]] == ["TTFT", "TPOT", "ITL", "E2EL", "output tok/s"]
    assert 0 < record["cases"][2]["timing"]["samples"] <= 8 * 5  # 6 tokens a request: at most 5 chunk gaps
    records = plots.load_serve_records([str(tmp_path)])
    written = plots.plot(records, tmp_path / "figs")
    assert [p.name for p in written] == ["throughput_vs_concurrency.png", "latency_percentiles.png"]
    assert all(p.stat().st_size > 10_000 for p in written)
    assert "| fake | 4 |" in plots.table(records)


def assert_harness_record(record: dict) -> None:
    """A record of kernel_lab/harness/results.py (its schema, when jsonschema is installed) whose cases and
    summary are what its own per-request rows give."""
    from kernel_lab.harness.bench import summarize as timing_of
    from kernel_lab.harness.results import SCHEMA_VERSION, validate

    assert record["schema_version"] == SCHEMA_VERSION and record["project"] == "09_engine"
    assert "record_type" not in record and {"date", "torch", "gpu", "python"} <= set(record["env"])
    pytest.importorskip("jsonschema")
    assert validate(record)
    serve, cases = record["serve"], {c["name"]: c for c in record["cases"]}
    rows = serve["requests"]
    samples = bench_serve.latency_samples(rows)
    recomputed = bench_serve.summarize_rows(rows, serve["metrics"]["duration_s"])
    for key, name, _ in bench_serve.LATENCIES:
        if key not in samples:  # a converted record: no per-gap data, ITL kept as the run summarised it
            assert name not in cases and serve["metrics"][key]["count"] > 0
            continue
        timing = timing_of(samples[key], {}).to_dict()
        assert {k: cases[name]["timing"][k] for k in ("median_ms", "p20_ms", "p80_ms", "min_ms", "samples")} == {
            k: timing[k] for k in ("median_ms", "p20_ms", "p80_ms", "min_ms", "samples")}
        assert cases[name]["metric"] == {"unit": "ms", "value": timing["median_ms"]}
        assert serve["metrics"][key] == pytest.approx(recomputed[key], rel=1e-12)
    throughput = cases["output tok/s"]
    assert throughput["timing"]["median_ms"] == pytest.approx(serve["metrics"]["duration_s"] * 1e3)
    assert throughput["metric"]["value"] == pytest.approx(recomputed["output_throughput"], rel=1e-12)
    for key in ("duration_s", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput"):
        assert serve["metrics"][key] == pytest.approx(recomputed[key], rel=1e-12), key


COMMITTED = sorted((Path(__file__).resolve().parents[3] / "results" / "09_engine").glob("serve*/*.json"))


@pytest.mark.parametrize("path", COMMITTED, ids=[p.name for p in COMMITTED])
def test_committed_serve_records_are_harness_records_computed_from_their_rows(path):
    assert_harness_record(json.loads(path.read_text()))


def test_json_schema_workload_sends_one_schema_through_either_endpoint():
    from kernel_lab.bench.serve import BENCH_JSON_SCHEMA, structured_output_fields
    from kernel_lab.engine.structured_output import make_spec, parse_structured_output

    expected = make_spec("json", BENCH_JSON_SCHEMA, "x")
    for chat in (True, False):
        spec = parse_structured_output(structured_output_fields("json-schema", chat))
        assert (spec.kind, spec.value) == (expected.kind, expected.value)
    assert structured_output_fields("none", True) == {}
    with pytest.raises(ValueError, match="structured output"):
        structured_output_fields("yaml", False)
