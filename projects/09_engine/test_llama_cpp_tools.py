"""llama.cpp's own tools as baselines (kernel_lab/bench/llama_cpp_tools.py): the parsers on output captured from
the pinned build (testdata/llama_cpp, bundled SmolLM2 Q4_1, one thread, on a loaded 2-core machine: the figures
are not measurements), the command lines, the build lookup, and a smoke run of each tool on the bundled model
with tiny shapes when `make llama-cpp-env` has built them (skipped with the reason otherwise)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kernel_lab.bench import llama_cpp_tools as tools
from kernel_lab.bench.throughput import gguf_path

DATA = Path(__file__).resolve().parent / "testdata" / "llama_cpp"
INFO = {"key": "k", "variant": "native", "tools": ["llama-bench", "llama-batched-bench"],
        "llama_cpp_python_version": "0.3.36", "llama_cpp_commit": "0c1e57098bba43ac29e6e3b677cdceebdd22334f",
        "cmake_flags": ["-DGGML_NATIVE=ON"], "compiler_flags": ["-mno-amx-tile"], "built_on_cpu": "AMD EPYC",
        "built_on_cpu_isa": {"avx2": True, "avx512f": True}, "built_at": "2026-12-03T13:00:00Z"}


def test_llama_bench_json():
    (tg,) = tools.parse_llama_bench((DATA / "llama-bench-tg16.json").read_text())
    assert (tg["n_prompt"], tg["n_gen"], tg["n_threads"]) == (0, 16, 1)
    assert tg["avg_ts"] == pytest.approx(8.06593) and tg["build_commit"] == "0c1e570"
    (pp,) = tools.parse_llama_bench((DATA / "llama-bench-pp64.json").read_text())
    assert (pp["n_prompt"], pp["n_gen"]) == (64, 0) and pp["avg_ts"] == pytest.approx(24.042622)
    with pytest.raises(ValueError, match="not JSON"):
        tools.parse_llama_bench("| model | size |")
    with pytest.raises(ValueError, match="no tests"):
        tools.parse_llama_bench("[]")
    with pytest.raises(ValueError, match="lacks avg_ts"):
        tools.parse_llama_bench(json.dumps([{"n_prompt": 0, "n_gen": 16, "n_threads": 1, "stddev_ts": 0}]))


def test_llama_batched_bench_table():
    (row,) = tools.parse_batched_bench((DATA / "llama-batched-bench-pp16-tg8-b4.txt").read_text())
    assert row == {"pp": 16, "tg": 8, "b": 4, "n_kv": 96, "t_pp_s": 3.596, "s_pp_tok_s": 17.80, "t_tg_s": 2.649,
                   "s_tg_tok_s": 12.08, "t_s": 6.245, "s_tok_s": 15.37}
    assert row["s_tok_s"] == pytest.approx(row["b"] * (row["pp"] + row["tg"]) / row["t_s"], rel=1e-3)
    rows = tools.parse_batched_bench((DATA / "llama-batched-bench-pp8-tg4-b1-2-4.txt").read_text())
    assert [r["b"] for r in rows] == [1, 2, 4] and [r["s_tok_s"] for r in rows] == [15.54, 15.71, 23.06]
    with pytest.raises(ValueError, match="no llama-batched-bench table"):
        tools.parse_batched_bench("llama_batched_bench: n_kv_max = 1024\n")
    with pytest.raises(ValueError, match="unknown columns"):
        tools.parse_batched_bench("| PP | TG | B | X | S t/s |\n|--|--|--|--|--|\n| 1 | 1 | 1 | 1 | 1 |\n")
    with pytest.raises(ValueError, match="has 2 cells"):
        tools.parse_batched_bench("| PP | TG | B | N_KV | T s | S t/s |\n|--|--|--|--|--|--|\n| 8 | 4 |\n")


def test_command_lines(tmp_path):
    binary, model = tmp_path / "llama-bench", tmp_path / "m.gguf"
    assert tools.llama_bench_command(binary, model, 2, gen_len=128) == [
        str(binary), "-m", str(model), "-p", "0", "-n", "128", "-t", "2", "-r", "1", "-o", "json"]
    assert tools.llama_bench_command(binary, model, 1, prompt_len=512, repetitions=3)[3:11] == [
        "-p", "512", "-n", "0", "-t", "1", "-r", "3"]
    assert tools.llama_bench_command(binary, model, 2, gen_len=32, depth=8192, cache_type="q8_0")[13:] == [
        "-d", "8192", "-ctk", "q8_0", "-ctv", "q8_0"]
    with pytest.raises(ValueError, match="exactly one of prompt_len and gen_len"):
        tools.llama_bench_command(binary, model, 1, prompt_len=8, gen_len=8)
    with pytest.raises(ValueError, match="threads and repetitions"):
        tools.llama_bench_command(binary, model, 0, gen_len=8)
    # the context holds every sequence's prompt and output
    assert tools.batched_bench_command(binary, model, 128, 128, 8, 2)[3:] == [
        "-c", "2048", "-b", "2048", "-ub", "512", "-npp", "128", "-ntg", "128", "-npl", "8", "-t", "2"]
    with pytest.raises(ValueError, match="batch and threads must be >= 1"):
        tools.batched_bench_command(binary, model, 128, 128, 0, 2)
    server = tools.llama_server_command(binary, model, 8123, 4, 2, 300)
    assert server[server.index("--host") + 1] == "127.0.0.1" and "-cb" in server
    assert server[server.index("-np") + 1] == "4" and server[server.index("-c") + 1] == "1200"
    assert server[server.index("-t") + 1] == server[server.index("-tb") + 1] == "2"
    with pytest.raises(ValueError, match="port in 1..65535"):
        tools.llama_server_command(binary, model, 0, 4, 2, 300)


def test_find_tools_names_the_build_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="run `make llama-cpp-env`"):
        tools.find_tools("native", tmp_path)
    with pytest.raises(FileNotFoundError, match="LLAMA_CPP_AVX2=1"):
        tools.find_tools("avx2", tmp_path)
    with pytest.raises(ValueError, match="build must be one of native, avx2; got 'avx512'"):
        tools.find_tools("avx512", tmp_path)
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / tools.INFO_FILE).write_text(json.dumps(INFO))
    (bin_dir / "llama-bench").write_text("")
    found = tools.find_tools("native", tmp_path)
    assert found.path("llama-bench") == bin_dir / "llama-bench"
    with pytest.raises(FileNotFoundError, match="no llama-batched-bench"):  # listed but absent
        found.path("llama-batched-bench")
    with pytest.raises(FileNotFoundError, match="no llama-server"):  # not built
        found.path("llama-server")
    assert tools.missing("native", ("llama-bench",), tmp_path) is None
    assert "no llama-server" in tools.missing("native", ("llama-server",), tmp_path)
    assert found.provenance("llama-bench") == {
        "tool": "llama-bench", "build": "native", "llama_cpp_commit": INFO["llama_cpp_commit"],
        "llama_cpp_python_sdist": "0.3.36", "cmake_flags": ["-DGGML_NATIVE=ON"], "compiler_flags": ["-mno-amx-tile"],
        "cpu": "AMD EPYC", "cpu_isa": {"avx2": True, "avx512f": True}}


def test_measure_picks_the_tool_and_quantity(tmp_path, monkeypatch):
    found = tools.LlamaCppTools(tmp_path, INFO)
    for name in INFO["tools"]:
        (tmp_path / name).write_text("")
    outputs = {"tg": (DATA / "llama-bench-tg16.json").read_text(), "pp": (DATA / "llama-bench-pp64.json").read_text(),
               "batched": (DATA / "llama-batched-bench-pp16-tg8-b4.txt").read_text()}
    ran = []

    def fake_run(command, timeout=0):
        ran.append(command)
        if command[0].endswith("llama-batched-bench"):
            return outputs["batched"]
        return outputs["pp" if command[command.index("-p") + 1] != "0" else "tg"]

    monkeypatch.setattr(tools, "run_tool", fake_run)
    tg = tools.measure(found, tmp_path / "m.gguf", 1, gen_len=16)
    assert tg["tool"] == "llama-bench" and tg["tok_s"] == pytest.approx(8.06593) and "batch-1 decode" in tg["quantity"]
    assert tg["llama_cpp_commit"] == INFO["llama_cpp_commit"] and tg["command"] == ran[0]
    pp = tools.measure(found, tmp_path / "m.gguf", 1, prompt_len=64)
    assert pp["tok_s"] == pytest.approx(24.042622) and pp["quantity"].startswith("pp64")
    batched = tools.measure(found, tmp_path / "m.gguf", 1, prompt_len=16, gen_len=8, batch=4)
    assert batched["tool"] == "llama-batched-bench" and batched["tok_s"] == pytest.approx(15.37)
    assert ran[-1][ran[-1].index("-npl") + 1] == "4"


@pytest.mark.parametrize("build", list(tools.BUILDS))
def test_smoke_run_on_the_bundled_model(build):
    """Each built tool runs on the bundled GGUF with tiny shapes and its output parses (numbers positive)."""
    why = tools.missing(build, ("llama-bench", "llama-batched-bench"))
    if why:
        pytest.skip(why)
    found, model = tools.find_tools(build), gguf_path(None)
    tg = tools.measure(found, model, 1, gen_len=4)
    assert tg["output"]["n_gen"] == 4 and tg["tok_s"] > 0 and tg["output"]["build_commit"] == \
        found.info["llama_cpp_commit"][:7]
    batched = tools.measure(found, model, 1, prompt_len=8, gen_len=4, batch=2)
    assert (batched["output"]["pp"], batched["output"]["tg"], batched["output"]["b"]) == (8, 4, 2)
    assert batched["tok_s"] > 0


def test_the_avx2_build_holds_no_avx512_code():
    """The avx2 build is what an AVX2 machine runs: its CPU backend has 256-bit code and no 512-bit registers
    (the native build's, on an AVX-512 machine, has them)."""
    why = tools.missing("avx2", ("llama-bench",))
    if why:
        pytest.skip(why)
    if shutil.which("objdump") is None:
        pytest.skip("no objdump to read the build's instructions")
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(tools.find_tools("avx2").bin_dir /
                                                                        "libggml-cpu.so")],
                             capture_output=True, text=True, check=True).stdout
    assert "%ymm" in listing and "%zmm" not in listing
