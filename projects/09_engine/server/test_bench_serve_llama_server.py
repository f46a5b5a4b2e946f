"""`kernel-lab bench serve --llama-server` (kernel_lab/bench/serve_pair.py): both servers' command lines, the
record holding both runs, and an end-to-end run on the bundled model with tiny shapes when `make llama-cpp-env`
has built llama-server (skipped with the reason otherwise)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernel_lab.bench import llama_cpp_tools, serve_pair
from kernel_lab.bench import serve as bench_serve
from kernel_lab.bench.serve import RequestResult, request_rows
from kernel_lab.harness import results
from kernel_lab.harness.env import environment_record

PROVENANCE = {"tool": "llama-server", "build": "native", "llama_cpp_commit": "0c1e57098bba43ac29e6",
              "cmake_flags": ["-DGGML_NATIVE=ON"], "cpu_isa": {"avx2": True}}


def test_both_servers_get_the_same_slots_threads_and_loopback(tmp_path):
    (tmp_path / "llama-server").write_text("")
    tools = llama_cpp_tools.LlamaCppTools(tmp_path, {"variant": "native", "tools": ["llama-server"]})
    commands = serve_pair.server_commands(tmp_path / "m.gguf", 8, 2, 300, tools, (8001, 8002), python="py")
    ours, theirs = commands["kernel-lab"], commands["llama-server"]
    assert ours[:4] == ["py", "-m", "kernel_lab.cli", "serve"]
    assert ours[ours.index("--host") + 1] == theirs[theirs.index("--host") + 1] == "127.0.0.1"
    assert ours[ours.index("--model") + 1] == theirs[theirs.index("-m") + 1] == str(tmp_path / "m.gguf")
    assert ours[ours.index("--max-num-seqs") + 1] == theirs[theirs.index("-np") + 1] == "8" and "-cb" in theirs
    assert ours[ours.index("--max-model-len") + 1] == "300" and theirs[theirs.index("-c") + 1] == "2400"
    assert theirs[theirs.index("-t") + 1] == "2"
    assert (ours[ours.index("--port") + 1], theirs[theirs.index("--port") + 1]) == ("8001", "8002")


def _run_record(label: str, output_tokens: int, duration_s: float):
    serve = {"label": "", "server_label": label, "device": "cpu", "base_url": "http://127.0.0.1:1",
             "endpoint": "/v1/completions", "model": "m", "request_rate": "inf", "burstiness": 1.0,
             "max_concurrency": 2, "host_load_avg_1m": {"start": 0.0, "end": 0.0},
             "dataset": {"name": "fixed", "num_prompts": 2, "input_len": 8, "output_len": output_tokens,
                         "range_ratio": 0.0, "seed": 0, "ignore_eos": True, "structured_output": "none"}}
    rows = request_rows([RequestResult(True, prompt_len=8, output_tokens=output_tokens, ttft_s=0.1, e2el_s=0.5,
                                       itl_s=[0.1] * (output_tokens - 1))] * 2)
    return bench_serve.build_record(serve, rows, duration_s, env=environment_record())


def test_the_pair_record_holds_both_runs():
    ours, theirs = _run_record("kernel-lab", 4, 1.0), _run_record("llama-server", 4, 2.0)  # 8 and 4 output tok/s
    record = serve_pair.pair_record(ours, theirs, ["llama-server", "-np", "2"], PROVENANCE).record
    results.validate(record)
    names = [c["name"] for c in record["cases"]]
    assert names[:len(ours.record["cases"])] == [c["name"] for c in ours.record["cases"]]
    assert names[len(ours.record["cases"]):] == [f"llama-server: {c['name']}" for c in theirs.record["cases"]]
    pair = record["serve_pair"]
    assert pair["output_tok_s"] == {"kernel-lab": pytest.approx(8.0), "llama-server": pytest.approx(4.0)}
    assert pair["ratio_output_tok_s"] == pytest.approx(2.0)
    assert pair["llama_server_build"] == PROVENANCE and pair["llama-server"]["server_label"] == "llama-server"
    assert record["benchmark"].startswith("bench serve, kernel-lab vs llama-server:")
    assert "(kernel-lab / llama-server 2.00x)" in record["headline"]["text"]
    assert "0c1e57098b" in record["description"]


def test_concurrency_is_required(capsys):
    args = bench_serve.argparse.Namespace(llama_server=True, max_concurrency=None)
    assert bench_serve.run_bench_serve(args) == 2
    assert "give --max-concurrency" in capsys.readouterr().err


def test_a_server_that_does_not_start_is_reported(tmp_path, monkeypatch, capsys, bundled_model):
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / llama_cpp_tools.INFO_FILE).write_text(json.dumps({"variant": "native", "tools": ["llama-server"]}))
    (bin_dir / "llama-server").write_text("#!/bin/sh\necho 'cannot load the model' >&2\nexit 3\n")
    (bin_dir / "llama-server").chmod(0o755)
    monkeypatch.setattr(llama_cpp_tools, "TOOLS_ROOT", tmp_path)
    status = bench_serve.main(["--llama-server", "--threads", "1", "--max-concurrency", "1", "--dataset-name",
                               "fixed", "--num-prompts", "1", "--random-input-len", "4", "--random-output-len", "2"])
    assert status == 1
    err = capsys.readouterr().err
    assert "llama-server did not start" in err and "exited with 3" in err and "cannot load the model" in err


@pytest.mark.slow
def test_end_to_end_on_the_bundled_model(tmp_path, bundled_model):
    """Both servers started here, two tiny requests at concurrency 1 and 2: one record per level, both
    servers' requests all completed, with the build named."""
    why = llama_cpp_tools.missing("native", ("llama-server",))
    if why:
        pytest.skip(why)
    status = bench_serve.main(["--llama-server", "--threads", "1", "--max-concurrency", "1,2", "--dataset-name",
                               "fixed", "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "4",
                               "--result-dir", str(tmp_path)])
    assert status == 0
    paths = sorted(Path(tmp_path).glob("pair-*.json"))
    assert [p.name.split("-c")[-1].split("-")[0] for p in paths] == ["1", "2"]
    for path in paths:
        record = json.loads(path.read_text())
        results.validate(record)
        for run in (record["serve"], record["serve_pair"]["llama-server"]):
            assert run["metrics"]["completed"] == 2 and run["metrics"]["failed"] == 0
            assert run["metrics"]["total_output_tokens"] == 8
        assert record["serve_pair"]["llama_server_build"]["tool"] == "llama-server"
