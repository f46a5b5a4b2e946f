"""`kernel-lab bench serve --llama-server`: the same client, workload and concurrency against `kernel-lab serve`
and llama.cpp's own `llama-server`, both started here on loopback on the same GGUF, one record per concurrency
holding both.

    kernel-lab bench serve --llama-server [--gguf F.gguf] [--threads 2] --max-concurrency 1,8,32 \\
        --dataset-name fixed --random-input-len 128 --random-output-len 128 --num-prompts 32 \\
        --result-dir results/09_engine/serve

llama-server (`make llama-cpp-env` builds it; `--llama-cpp-build avx2` picks that build where it has one) runs
`-np N -cb` with N = the largest concurrency and a context of N x (longest request) tokens, `-t`/`-tb` threads;
kernel-lab serve runs with `--max-num-seqs N`, the same threads (OMP_NUM_THREADS). Each server is started
once, warmed with one request, and the concurrency levels then alternate between the two servers. The record
is the kernel-lab run's (its cases and `serve` block) with llama-server's cases beside them ("llama-server: "
names) and a `serve_pair` block: llama-server's `serve` block, its command and build (llama.cpp commit, flags,
the CPU's ISA) and the output tok/s ratio.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from . import llama_cpp_tools
from .serve import benchmark_once, build_workload, record_file_name
from .workload import load_tokenizer

HOST = llama_cpp_tools.HOST


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--llama-server: start kernel-lab serve and llama-server and compare them")
    group.add_argument("--llama-server", action="store_true",
                       help="start both servers here (loopback) on --gguf and run the benchmark against each")
    group.add_argument("--gguf", default=None, help="the GGUF both servers load (default: the bundled model)")
    group.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of each server")
    group.add_argument("--llama-cpp-build", default="native", choices=list(llama_cpp_tools.BUILDS),
                       help="which llama_cpp_tools.sh build of llama-server runs")
    group.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to load")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_commands(gguf: Path, parallel: int, threads: int, context_per_slot: int, tools, ports: tuple[int, int],
                    python: str = sys.executable) -> dict[str, list[str]]:
    """{server label: command} for llama-server and kernel-lab serve with the same slots and threads (in the
    order they start: llama-server first, the quicker to load and to fail)."""
    ours = [python, "-m", "kernel_lab.cli", "serve", "--model", str(gguf), "--host", HOST, "--port", str(ports[0]),
            "--max-num-seqs", str(parallel), "--max-model-len", str(context_per_slot), "--device", "cpu",
            "--log-level", "warning"]
    theirs = llama_cpp_tools.llama_server_command(tools.path("llama-server"), gguf, ports[1], parallel, threads,
                                                  context_per_slot)
    return {"llama-server": theirs, "kernel-lab": ours}


def wait_ready(base_url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    """Until GET /v1/models answers 200; RuntimeError with the log's end if the server exits or times out."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{base_url}: the server exited with {process.returncode}: "
                               f"{log.read_text(errors='replace')[-2000:]}")
        try:
            if httpx.get(base_url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{base_url}: not ready after {timeout:.0f} s: {log.read_text(errors='replace')[-2000:]}")


def _start(stack: ExitStack, command: list[str], env: dict, log: Path) -> subprocess.Popen:
    out = stack.enter_context(open(log, "w"))
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)

    def stop():
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    stack.callback(stop)
    return process


def pair_record(ours, theirs, command: list[str], provenance: dict):
    """Our run's record with llama-server's cases beside ours and the `serve_pair` block."""
    record = copy.deepcopy(ours)
    for case in theirs.record["cases"]:
        record.record["cases"].append({**case, "name": f"llama-server: {case['name']}", "server": "llama-server"})
    ours_tok_s = ours.record["serve"]["metrics"]["output_throughput"]
    theirs_tok_s = theirs.record["serve"]["metrics"]["output_throughput"]
    serve = record.record["serve"]
    record.record["benchmark"] = record.record["benchmark"].replace(
        f"bench serve, {serve['server_label']}:", f"bench serve, {serve['server_label']} vs llama-server:")
    record.record["description"] += (f"; beside it llama.cpp's llama-server ({provenance['build']} build, llama.cpp "
                                     f"{provenance['llama_cpp_commit'][:10]}) on the same GGUF, workload, client and "
                                     "concurrency, its cases named 'llama-server: ...'")
    record.record["serve_pair"] = {"llama-server": theirs.record["serve"], "llama_server_command": command,
                                   "llama_server_build": provenance,
                                   "output_tok_s": {"kernel-lab": ours_tok_s, "llama-server": theirs_tok_s},
                                   "ratio_output_tok_s": ours_tok_s / theirs_tok_s if theirs_tok_s else None}
    ratio = f" (kernel-lab / llama-server {ours_tok_s / theirs_tok_s:.2f}x)" if theirs_tok_s else ""
    record.set_headline(f"{record.record['headline']['text']}; llama-server {theirs_tok_s:.1f} output tok/s{ratio}",
                        output_tok_s=ours_tok_s, llama_server_output_tok_s=theirs_tok_s)
    return record


def run_pair(args, levels: list[int | None]) -> int:
    from kernel_lab.harness.env import device_label, environment_record

    from .serve import _discover_model, format_summary, warm_up
    from .throughput import gguf_path

    if any(level is None for level in levels):
        print("bench serve --llama-server: give --max-concurrency (llama-server needs a slot count)", file=sys.stderr)
        return 2
    try:
        tools = llama_cpp_tools.find_tools(args.llama_cpp_build)
        tools.path("llama-server")
    except FileNotFoundError as exc:
        print(f"bench serve --llama-server: {exc}", file=sys.stderr)
        return 1
    gguf = gguf_path(args.gguf)
    tokenizer = load_tokenizer(args.tokenizer or str(gguf))
    requests = build_workload(tokenizer, dataset=args.dataset_name, num_prompts=args.num_prompts,
                              input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                              seed=args.seed)
    parallel = max(levels)
    context = max(r.prompt_len + r.output_len for r in requests) + 16  # room for a BOS and template tokens
    ports = (free_port(), free_port())
    commands = server_commands(gguf, parallel, args.threads, context, tools, ports)
    urls = {"kernel-lab": f"http://{HOST}:{ports[0]}", "llama-server": f"http://{HOST}:{ports[1]}"}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    record_env = environment_record()
    device = device_label(record_env) + " (servers on the same machine)"
    status = 0
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="kernel-lab-serve-pair-") as logs:
        models = {}
        for label, command in commands.items():
            log = Path(logs) / f"{label}.log"
            try:
                wait_ready(urls[label], _start(stack, command, env, log), log, args.startup_timeout)
            except RuntimeError as exc:
                print(f"bench serve --llama-server: {label} did not start: {exc}", file=sys.stderr)
                return 1
            models[label] = _discover_model(urls[label], args.api_key)["id"]
            if not warm_up(argparse.Namespace(**{**vars(args), "base_url": urls[label]}), requests, models[label]):
                return 1
        for concurrency in levels:
            runs = {}
            for label in commands:
                run_args = argparse.Namespace(**{**vars(args), "base_url": urls[label]})
                runs[label] = benchmark_once(run_args, requests, models[label], label, concurrency, record_env,
                                             device)
                print(format_summary(runs[label].record["serve"]))
                status |= bool(runs[label].record["serve"]["metrics"]["failed"])
            record = pair_record(runs["kernel-lab"], runs["llama-server"], commands["llama-server"],
                                 tools.provenance("llama-server"))
            if args.result_dir:
                name = "pair-" + record_file_name(record.record["serve"])
                print(f"wrote {record.write_to(Path(args.result_dir) / name)}")
    return int(status)
