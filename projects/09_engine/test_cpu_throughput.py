"""cpu_throughput.py's record assembly, from fake raw outputs (--reuse-raw), and the commands it would run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kernel_lab.harness import results

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("cpu_throughput", HERE / "cpu_throughput.py")
cpu_throughput = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu_throughput)

COPY_GBPS = 10.0
READ_GBPS = 6.0     # per thread
WEIGHT_BYTES = 100_000_000


@pytest.fixture(autouse=True)
def fake_ceilings(monkeypatch):
    monkeypatch.setattr(results, "ceilings", lambda device: {"copy": {"GBps": COPY_GBPS}, "matmul": {"TFLOPs": 1.0}})
    monkeypatch.setattr(cpu_throughput, "measure_read_bandwidth", lambda threads: {"GBps": READ_GBPS * threads,
                                                                                   "threads": threads})


def summary(backend, c, t, n, tok_s, input_len=16, output_len=8):
    out = {"backend": backend, "concurrency": c, "threads": t, "num_prompts": n, "input_len": input_len,
           "output_len": output_len, "num_requests": n, "output_tokens_per_second": tok_s,
           "elapsed_time": n * output_len / tok_s}
    if backend == "kernel-lab":
        out["engine_stats"] = {"weights": "quantized", "weight_bytes": WEIGHT_BYTES}
    if backend in ("llama.cpp", "llama.cpp-runner"):  # the runner's backend in `bench throughput` is llama.cpp
        out["llama_cpp"] = {"version": "0.3.36", "system_info": "CPU : AVX2 = 1 |", "gguf": "/x/model.gguf"}
    return out


SPEEDS = {"kernel-lab": 30.0, "transformers": 10.0, "llama.cpp": 40.0}
RUNNER = cpu_throughput.BASELINES["llama.cpp-runner"]
BUILT_TOOLS_ROOT = cpu_throughput.llama_cpp_tools.TOOLS_ROOT   # before the fixture below hides it


@pytest.fixture(autouse=True)
def no_llama_cpp_tools(monkeypatch, tmp_path):
    """No built llama.cpp tools unless a test fakes them (a checkout's own build must not run here)."""
    monkeypatch.setattr(cpu_throughput.llama_cpp_tools, "TOOLS_ROOT", tmp_path / "no-llama-cpp-tools")


def write_raw(out: Path, concurrency=(1, 4), threads=(1, 2), backends=("kernel-lab", "transformers", "llama.cpp")):
    raw = out / "09_engine" / "raw"
    raw.mkdir(parents=True)
    for c in concurrency:
        n = 2 if c == 1 else 6
        for t in threads:
            for b in backends:
                (raw / cpu_throughput.raw_name(b, c, t)).write_text(json.dumps(summary(b, c, t, n, SPEEDS[b] * c * t)))


def test_record_from_raw_outputs(tmp_path, capsys):
    write_raw(tmp_path)
    cpu_throughput.main(["--reuse-raw", "--out", str(tmp_path), "--concurrency", "1", "4", "--threads", "1", "2",
                         "--num-prompts", "6", "--num-prompts-c1", "2", "--input-len", "16", "--output-len", "8",
                         "--backends", "transformers", "llama.cpp-runner", "--repeats", "1"])
    paths = list((tmp_path / "09_engine").glob("cpu-throughput-*.json"))
    assert len(paths) == 1
    record = json.loads(paths[0].read_text())
    results.validate(record)
    assert record["weight_bytes"] == WEIGHT_BYTES
    cases = {(c["shape"]["concurrency"], c["shape"]["threads"]): c for c in record["cases"]}
    assert sorted(cases) == [(1, 1), (1, 2), (4, 1), (4, 2)]
    for (c, t), case in cases.items():
        assert case["metric"] == {"unit": "tok/s", "value": pytest.approx(30.0 * c * t)}
        assert case["baseline_output_tok_s"] == {"transformers generate": pytest.approx(10.0 * c * t),
                                                 RUNNER: pytest.approx(40.0 * c * t)}
        assert case["ratio"] == {"transformers generate": pytest.approx(3.0), RUNNER: pytest.approx(0.75)}
        assert case["speedup"] == {"transformers generate": pytest.approx(3.0), RUNNER: pytest.approx(0.75)}
        bound = c * COPY_GBPS * 1e9 / WEIGHT_BYTES
        assert case["ceiling_tok_s"] == pytest.approx(bound)
        assert case["percent_of_ceiling"] == pytest.approx(100 * 30.0 * c * t / bound)
        assert case["weights"] == "quantized"
        assert case["llama_cpp"]["version"] == "0.3.36"
        assert case["llama_cpp_runner_case"] == cpu_throughput.RUNNER_CASE and "llama_cpp_tool" not in case
        assert case["shape"]["num_prompts"] == (2 if c == 1 else 6)
    assert f"c4 t2: 3.00x transformers generate, 0.75x {RUNNER}" in record["headline"]["text"]
    assert record["isa"] == {"kernel_lab_cpu_isa": "native", "llama_cpp_build": "native", "emulated": False}
    # The rendered RESULTS.md section picks the record up.
    assert "CPU throughput vs transformers, vLLM CPU and llama.cpp" in results.render(tmp_path)


def test_reuse_refuses_raw_output_of_another_run(tmp_path):
    write_raw(tmp_path, concurrency=(4,), threads=(1,))
    (tmp_path / "09_engine" / "raw" / cpu_throughput.raw_name("kernel-lab", 4, 2)).write_text(
        json.dumps(summary("kernel-lab", 4, 1, 6, 30.0)))  # says 1 thread under the 2-thread name
    with pytest.raises(SystemExit, match="does not hold the run"):
        cpu_throughput.main(["--reuse-raw", "--out", str(tmp_path), "--concurrency", "4", "--threads", "2",
                             "--num-prompts", "6", "--input-len", "16", "--output-len", "8", "--repeats", "1",
                             "--backends"])


def test_repeated_pair_takes_each_backends_median_run(tmp_path):
    """kernel-lab and llama.cpp's runner run three times per point: the record holds every run's wall time
    and each backend's median run; the once-run baselines keep their single run."""
    write_raw(tmp_path, concurrency=(4,), threads=(2,))
    raw = tmp_path / "09_engine" / "raw"
    for backend, speeds in (("kernel-lab", (20.0, 40.0)), ("llama.cpp", (50.0, 10.0))):
        for r, tok_s in enumerate(speeds, start=1):
            (raw / cpu_throughput.raw_name(backend, 4, 2, r)).write_text(json.dumps(summary(backend, 4, 2, 6, tok_s)))
    cpu_throughput.main(["--reuse-raw", "--out", str(tmp_path), "--concurrency", "4", "--threads", "2",
                         "--num-prompts", "6", "--input-len", "16", "--output-len", "8",
                         "--backends", "transformers", "llama.cpp-runner"])
    record = json.loads(next((tmp_path / "09_engine").glob("cpu-throughput-*.json")).read_text())
    (case,) = record["cases"]
    # runs: kernel-lab 240, 20, 40 tok/s (median 40); llama.cpp 320, 50, 10 (median 50); transformers 80 once
    assert case["metric"]["value"] == pytest.approx(40.0)
    assert case["baseline_output_tok_s"] == {"transformers generate": pytest.approx(80.0),
                                             RUNNER: pytest.approx(50.0)}
    assert case["ratio"][RUNNER] == pytest.approx(0.8)
    elapsed_ms = sorted(6 * 8 / v * 1e3 for v in (240.0, 20.0, 40.0))
    assert case["timing"]["samples"] == 3 and case["timing"]["min_ms"] == pytest.approx(elapsed_ms[0])
    assert case["timing"]["median_ms"] == pytest.approx(elapsed_ms[1])
    assert case["baselines"][RUNNER]["timing"]["samples"] == 3
    assert case["baselines"]["transformers generate"]["timing"]["samples"] == 1


def test_commands_and_skipped_baselines(tmp_path, monkeypatch, capsys):
    commands = []
    real_run = cpu_throughput.subprocess.run

    def fake_run(cmd, **kwargs):
        if "throughput" not in cmd:  # e.g. the environment record's git call
            return real_run(cmd, **kwargs)
        commands.append((cmd, kwargs["env"]))
        backend = cmd[cmd.index("--backend") + 1]
        c, t = int(cmd[cmd.index("--max-num-seqs") + 1]), int(cmd[cmd.index("--threads") + 1])
        n = int(cmd[cmd.index("--num-prompts") + 1])
        Path(cmd[cmd.index("--output-json") + 1]).write_text(json.dumps(summary(backend, c, t, n, SPEEDS[backend])))

    monkeypatch.setattr(cpu_throughput.subprocess, "run", fake_run)
    fake_python = tmp_path / "llama-python"
    fake_python.write_text("")
    cpu_throughput.main(["--out", str(tmp_path), "--concurrency", "4", "--threads", "2", "--num-prompts", "6",
                         "--input-len", "16", "--output-len", "8", "--vllm-python", str(tmp_path / "absent"),
                         "--llama-cpp-python", str(fake_python), "--engine-args", "--max-num-batched-tokens 64",
                         "--backends", "transformers", "vllm", "llama.cpp", "llama.cpp-runner", "kernel-lab-fp32"])
    printed = capsys.readouterr().out
    assert "skipping vllm" in printed
    assert "skipping llama.cpp: no native build of llama.cpp's tools" in printed and "make llama-cpp-env" in printed
    names = [Path(cmd[cmd.index("--output-json") + 1]).name for cmd, _ in commands]
    assert names == ["kernel-lab-c4-t2.json", "transformers-c4-t2.json", "llama.cpp-c4-t2.json",
                     "kernel-lab-fp32-c4-t2.json", "kernel-lab-c4-t2-r1.json", "llama.cpp-c4-t2-r1.json",
                     "kernel-lab-c4-t2-r2.json", "llama.cpp-c4-t2-r2.json"]  # the compared pair, alternating
    by_backend = {Path(cmd[cmd.index("--output-json") + 1]).name.split("-c")[0]: (cmd, env) for cmd, env in commands}
    assert sorted(by_backend) == ["kernel-lab", "kernel-lab-fp32", "llama.cpp", "transformers"]
    ours, env = by_backend["kernel-lab"]
    assert ours[-2:] == ["--max-num-batched-tokens", "64"] and "--weights" not in ours
    fp32, _ = by_backend["kernel-lab-fp32"]
    assert fp32[fp32.index("--backend") + 1] == "kernel-lab" and fp32[-4:] == [
        "--max-num-batched-tokens", "64", "--weights", "float32"]
    assert env["OMP_NUM_THREADS"] == "2" and ours[ours.index("--threads") + 1] == "2"
    llama, _ = by_backend["llama.cpp"]
    assert llama[llama.index("--llama-cpp-python") + 1] == str(fake_python)
    assert "--max-num-batched-tokens" not in llama
    record = json.loads(next((tmp_path / "09_engine").glob("cpu-throughput-*.json")).read_text())
    assert set(record["cases"][0]["baselines"]) == {"transformers generate", RUNNER, "kernel-lab, float32 weights"}


def test_model_parameter_batch1_decode_and_prompt_throughput(tmp_path, monkeypatch):
    """--model reaches every backend's command and names the record; at concurrency 1 the case gives each
    backend's batch-1 decode rate from its decode-only steps and ours against the one-step weight-read bound;
    --prompt-throughput adds a case of prompt tok/s per thread count."""
    model = tmp_path / "random-llama-1b-v1" / "Q4_K_M.gguf"
    model.parent.mkdir()
    model.write_bytes(b"GGUF")
    monkeypatch.setattr(cpu_throughput, "fp32_weight_bytes", lambda model=None: pytest.fail("engine stats absent"))
    commands = []
    real_run = cpu_throughput.subprocess.run
    step_ms = {"kernel-lab": 50.0, "llama.cpp": 40.0}
    prompt_s = {"kernel-lab": 4.0, "llama.cpp": 5.0}

    def fake_run(cmd, **kwargs):
        if "throughput" not in cmd:  # e.g. the environment record's git call
            return real_run(cmd, **kwargs)
        commands.append(cmd)
        backend = cmd[cmd.index("--backend") + 1]
        c, t = int(cmd[cmd.index("--max-num-seqs") + 1]), int(cmd[cmd.index("--threads") + 1])
        n, input_len = int(cmd[cmd.index("--num-prompts") + 1]), int(cmd[cmd.index("--input-len") + 1])
        output_len = int(cmd[cmd.index("--output-len") + 1])
        out = summary(backend, c, t, n, SPEEDS[backend], input_len, output_len)
        out["total_prompt_tokens"] = n * input_len
        if output_len == 1:
            out["elapsed_time"] = prompt_s[backend]
        out["decode_steps"] = {"median_ms": step_ms[backend], "p20_ms": 1.0, "p80_ms": 2.0, "min_ms": 1.0,
                               "samples": 7, "method": {}}
        Path(cmd[cmd.index("--output-json") + 1]).write_text(json.dumps(out))

    monkeypatch.setattr(cpu_throughput.subprocess, "run", fake_run)
    fake_python = tmp_path / "llama-python"
    fake_python.write_text("")
    cpu_throughput.main(["--model", str(model), "--out", str(tmp_path), "--concurrency", "1", "--threads", "2",
                         "--num-prompts-c1", "2", "--input-len", "16", "--output-len", "8", "--repeats", "1",
                         "--backends", "llama.cpp-runner", "--llama-cpp-python", str(fake_python),
                         "--prompt-throughput", "512", "--num-prompts-pp", "3"])
    assert all(cmd[cmd.index("--model") + 1] == str(model) for cmd in commands) and len(commands) == 4
    raw = tmp_path / "09_engine" / "raw" / "random-llama-1b-v1-q4-k-m"
    assert sorted(p.name for p in raw.iterdir()) == ["kernel-lab-c1-t2.json", "kernel-lab-pp512-t2.json",
                                                     "llama.cpp-c1-t2.json", "llama.cpp-pp512-t2.json"]
    (path,) = (tmp_path / "09_engine").glob("cpu-throughput-on-*.json")
    record = json.loads(path.read_text())
    results.validate(record)
    assert record["benchmark"] == "CPU throughput on random-llama-1b-v1 Q4_K_M"
    decode, prompt = record["cases"]
    b1 = decode["batch1_decode"]
    assert b1["tok_s"] == {"kernel-lab": pytest.approx(20.0), RUNNER: pytest.approx(25.0)}
    single = COPY_GBPS * 1e9 / WEIGHT_BYTES
    assert b1["ceiling_tok_s"] == pytest.approx(single)
    assert b1["percent_of_ceiling"] == pytest.approx(100 * 20.0 / single)
    read_bound = READ_GBPS * 2 * 1e9 / WEIGHT_BYTES   # two threads' read bandwidth
    assert b1["read_ceiling_tok_s"] == pytest.approx(read_bound)
    assert b1["percent_of_read_ceiling"] == pytest.approx(100 * 20.0 / read_bound)
    assert prompt["shape"] == {"concurrency": 1, "threads": 2, "num_prompts": 3, "input_len": 512, "output_len": 1}
    assert prompt["quantity"] == "prompt tokens per second"
    assert prompt["metric"] == {"unit": "tok/s", "value": pytest.approx(3 * 512 / 4.0)}
    assert prompt["ratio"] == {RUNNER: pytest.approx(5.0 / 4.0)}
    assert f"pp512 t2: 1.25x {RUNNER}" in record["headline"]["text"]


def test_reference_checkout_runs_as_an_alternating_baseline_from_its_own_tree(tmp_path, monkeypatch):
    """--reference-checkout DIR: that checkout's engine (cwd and PYTHONPATH there) alternates with ours, and the
    record and raw outputs are apart from the bundled model's (no committed record is overwritten)."""
    ref = tmp_path / "ref"
    ref.mkdir()
    commands = []
    real_run = cpu_throughput.subprocess.run
    monkeypatch.setattr(cpu_throughput, "git_commit", lambda checkout: "abc1234def5678")

    def fake_run(cmd, **kwargs):
        if "throughput" not in cmd:
            return real_run(cmd, **kwargs)
        commands.append((Path(kwargs["cwd"]), kwargs["env"]["PYTHONPATH"], Path(cmd[cmd.index("--output-json") + 1])))
        n = int(cmd[cmd.index("--num-prompts") + 1])
        speed = 20.0 if Path(kwargs["cwd"]) == ref else 30.0
        commands[-1][2].write_text(json.dumps(summary("kernel-lab", 4, 2, n, speed)))

    monkeypatch.setattr(cpu_throughput.subprocess, "run", fake_run)
    monkeypatch.chdir(tmp_path)   # a relative --out, as the README's commands give it
    cpu_throughput.main(["--out", ".", "--concurrency", "4", "--threads", "2", "--num-prompts", "6",
                         "--input-len", "16", "--output-len", "8", "--backends", "--repeats", "2",
                         "--reference-checkout", str(ref)])
    # the command runs in the other checkout: a relative output path would land in its tree
    assert all(out.is_absolute() and out.is_relative_to(tmp_path) for _, _, out in commands)
    assert [(cwd == ref, path == ref) for cwd, path, _ in
            [(c, Path(p), o) for c, p, o in commands]] == [(False, False), (True, True)] * 2
    names = [out.name for _, _, out in commands]
    assert names == ["kernel-lab-c4-t2.json", "kernel-lab-ref-c4-t2.json", "kernel-lab-c4-t2-r1.json",
                     "kernel-lab-ref-c4-t2-r1.json"]
    assert all(out.parent.name.startswith("cpu-throughput-before-and-after") for _, _, out in commands)
    (path,) = (tmp_path / "09_engine").glob("cpu-throughput-before-and-after-*.json")
    (case,) = json.loads(path.read_text())["cases"]
    assert case["ratio"] == {"kernel-lab, reference checkout": pytest.approx(1.5)}
    assert "abc1234def5678" in json.loads(path.read_text())["description"]


def test_llama_cpp_tools_at_each_point_and_the_avx2_mode(tmp_path, monkeypatch):
    """The default llama.cpp baseline is its own tools, alternating with our runs: llama-bench tgN against our
    batch-1 decode rate at concurrency 1, ppN against our prompt rate, llama-batched-bench (B = concurrency)
    against our total tok/s; each case names the tool and its build. --isa avx2 runs our kernels with
    KERNEL_LAB_CPU_ISA=avx2 and llama.cpp's avx2 build, into a record of its own labelled as emulated."""
    tools_module = cpu_throughput.llama_cpp_tools
    info = {"variant": "avx2", "tools": ["llama-bench", "llama-batched-bench"], "llama_cpp_python_version": "0.3.36",
            "llama_cpp_commit": "0c1e570abc", "cmake_flags": ["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON"],
            "compiler_flags": [], "built_on_cpu": "AMD EPYC", "built_on_cpu_isa": {"avx2": True, "avx512f": True}}
    bin_dir = tmp_path / "no-llama-cpp-tools" / "build-avx2" / "bin"   # the autouse fixture's TOOLS_ROOT
    bin_dir.mkdir(parents=True)
    (bin_dir / tools_module.INFO_FILE).write_text(json.dumps(info))
    for tool in info["tools"]:
        (bin_dir / tool).write_text("")
    data = HERE / "testdata" / "llama_cpp"
    order, envs = [], []

    def fake_tool(command, timeout=0):
        order.append(Path(command[0]).name)
        assert command[command.index("-t") + 1] == "2" and command[0].startswith(str(bin_dir))
        if command[0].endswith("llama-batched-bench"):
            assert command[command.index("-npl") + 1] == "4" and command[command.index("-npp") + 1] == "16"
            return (data / "llama-batched-bench-pp16-tg8-b4.txt").read_text()        # S t/s 15.37
        if command[command.index("-p") + 1] == "512":
            return (data / "llama-bench-pp64.json").read_text()                      # avg_ts 24.04
        assert command[command.index("-n") + 1] == "8"
        return (data / "llama-bench-tg16.json").read_text()                          # avg_ts 8.07

    real_run = cpu_throughput.subprocess.run

    def fake_run(cmd, **kwargs):
        if "throughput" not in cmd:
            return real_run(cmd, **kwargs)
        order.append("kernel-lab")
        envs.append(kwargs["env"].get("KERNEL_LAB_CPU_ISA"))
        c, t = int(cmd[cmd.index("--max-num-seqs") + 1]), int(cmd[cmd.index("--threads") + 1])
        n, input_len = int(cmd[cmd.index("--num-prompts") + 1]), int(cmd[cmd.index("--input-len") + 1])
        output_len = int(cmd[cmd.index("--output-len") + 1])
        out = summary("kernel-lab", c, t, n, 30.0, input_len, output_len)
        out["total_prompt_tokens"] = n * input_len
        out["tokens_per_second"] = 46.11       # 3x llama-batched-bench's 15.37
        out["cpu_kernels"] = {"isa": kwargs["env"]["KERNEL_LAB_CPU_ISA"], "gguf_linear_path": "avx2"}
        out["decode_steps"] = {"median_ms": 62.0, "p20_ms": 1.0, "p80_ms": 2.0, "min_ms": 1.0, "samples": 7,
                               "method": {}}
        if output_len == 1:
            out["elapsed_time"] = n * input_len / 48.085   # 2x pp's 24.04
        Path(cmd[cmd.index("--output-json") + 1]).write_text(json.dumps(out))

    monkeypatch.setattr(tools_module, "run_tool", fake_tool)
    monkeypatch.setattr(cpu_throughput.subprocess, "run", fake_run)
    cpu_throughput.main(["--out", str(tmp_path), "--concurrency", "1", "4", "--threads", "2", "--num-prompts", "6",
                         "--num-prompts-c1", "2", "--input-len", "16", "--output-len", "8", "--repeats", "2",
                         "--backends", "llama.cpp", "--isa", "avx2", "--prompt-throughput", "512"])
    assert order == ["kernel-lab", "llama-bench"] * 2 + ["kernel-lab", "llama-batched-bench"] * 2 + [
        "kernel-lab", "llama-bench"] * 2
    assert envs == ["avx2"] * 6
    (path,) = (tmp_path / "09_engine").glob("cpu-throughput-*.json")
    record = json.loads(path.read_text())
    results.validate(record)
    assert record["benchmark"] == ("CPU throughput vs transformers, vLLM CPU and llama.cpp (AVX2 builds, emulated on "
                                   "this machine)")
    assert record["isa"]["emulated"] is True and "not an AVX2 machine" in record["isa"]["note"]
    assert record["isa"]["kernel_lab_cpu_kernels"] == {"isa": "avx2", "gguf_linear_path": "avx2"}
    raw = tmp_path / "09_engine" / "raw" / cpu_throughput.slug(record["benchmark"])
    assert (raw / "llama-batched-bench-c4-t2-r1.json").exists() and (raw / "llama-bench-pp512-t2.json").exists()
    c1, c4, pp = record["cases"]
    assert c1["llama_cpp_tool"]["tool"] == "llama-bench" and c1["llama_cpp_tool"]["gen_len"] == 8
    assert c1["llama_cpp_tool"]["ratio"] == pytest.approx((1e3 / 62.0) / 8.06593)
    assert c1["llama_cpp_tool"]["build"] == "avx2" and c1["llama_cpp_tool"]["cpu_isa"]["avx512f"] is True
    assert c4["llama_cpp_tool"]["tool"] == "llama-batched-bench"
    assert c4["llama_cpp_tool"]["ratio"] == pytest.approx(3.0, rel=1e-3)
    assert c4["llama_cpp_tool"]["runs_tok_s"] == [15.37, 15.37]
    assert pp["llama_cpp_tool"]["ratio"] == pytest.approx(2.0, rel=1e-3)
    assert "c4 t2: 3.00x llama-batched-bench S t/s" in record["headline"]["text"]
    assert "pp512 t2: 2.00x llama-bench pp512" in record["headline"]["text"]
    # rebuilt from those raw outputs alone, the same comparisons
    order.clear()
    cpu_throughput.main(["--out", str(tmp_path), "--concurrency", "1", "4", "--threads", "2", "--num-prompts", "6",
                         "--num-prompts-c1", "2", "--input-len", "16", "--output-len", "8", "--repeats", "2",
                         "--backends", "llama.cpp", "--isa", "avx2", "--prompt-throughput", "512", "--reuse-raw"])
    assert order == [] and json.loads(path.read_text())["cases"][1]["llama_cpp_tool"]["ratio"] == pytest.approx(3.0,
                                                                                                               rel=1e-3)


@pytest.mark.slow
def test_end_to_end_against_the_built_tools(tmp_path, monkeypatch, bundled_model):
    """Our engine and llama.cpp's built tools on the bundled model, tiny shapes: each case holds the tool's
    parsed output, its build and a positive ratio (the figures mean nothing at this size)."""
    monkeypatch.setattr(cpu_throughput.llama_cpp_tools, "TOOLS_ROOT", BUILT_TOOLS_ROOT)
    why = cpu_throughput.llama_cpp_tools.missing("native", ("llama-bench", "llama-batched-bench"))
    if why:
        pytest.skip(why)
    cpu_throughput.main(["--out", str(tmp_path), "--concurrency", "1", "2", "--threads", "1", "--num-prompts", "2",
                         "--num-prompts-c1", "1", "--input-len", "8", "--output-len", "4", "--repeats", "1",
                         "--backends", "llama.cpp"])
    (path,) = (tmp_path / "09_engine").glob("cpu-throughput-*.json")
    record = json.loads(path.read_text())
    results.validate(record)
    c1, c2 = (case["llama_cpp_tool"] for case in record["cases"])
    assert (c1["tool"], c1["output"]["n_gen"], c1["output"]["n_threads"]) == ("llama-bench", 4, 1)
    assert (c2["tool"], c2["output"]["b"], c2["output"]["pp"], c2["output"]["tg"]) == ("llama-batched-bench", 2, 8, 4)
    for tool in (c1, c2):
        assert tool["ratio"] > 0 and tool["build"] == "native" and "avx2" in tool["cpu_isa"]
