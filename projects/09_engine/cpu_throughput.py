"""CPU throughput of the engine against transformers' batched `generate`, vLLM CPU and llama.cpp's own tools, on
the same workload.

    python projects/09_engine/cpu_throughput.py [--model FILE.gguf|DIR] [--concurrency 1 8 32] [--threads 1 2]
        [--num-prompts 32] [--backends transformers vllm llama.cpp llama.cpp-runner] [--prompt-throughput 512]
        [--isa native|avx2] [--engine-args "--max-num-batched-tokens 512"] [--out results]

For each (concurrency, threads) it runs `kernel-lab bench throughput` in fresh processes, once per backend,
on the same fixed-length workload (the same random token ids, greedy, EOS ignored), and keeps the raw JSON
outputs under <out>/09_engine/raw/ (named backend-c<concurrency>-t<threads>[-r<repeat>].json). kernel-lab
and llama.cpp, the pair the targets compare, run `--repeats` times each (default 3), alternating, so that a
noisy neighbour on a shared machine hits both; the record keeps every run's wall time (median, p20, p80,
min) and takes each backend's median run. The engine runs with its
defaults (on CPU: float32 activations, and weights='auto', which computes on the GGUF's quantized blocks);
transformers and vLLM run in float32. vLLM runs with the Python of project 08's environment (`--vllm-python`,
default .venv-vllm), eager, one process, bound to as many cores as the others get threads.

llama.cpp is its own tools, built from the pinned source by `make llama-cpp-env` (llama_cpp_tools.sh), on the
GGUF itself with `threads` threads: at concurrency 1 llama-bench tg<output-len> against our batch-1 decode
rate (1 / median decode-only step), at a prompt-throughput point llama-bench pp<N> against our prompt tok/s,
at concurrency B > 1 llama-batched-bench with B sequences of input-len + output-len against our total tok/s
(its S t/s is the same quantity); each case's `llama_cpp_tool` holds the command, the tool's output, its build
flags, the llama.cpp commit and the CPU's ISA flags. `llama.cpp-runner` (not run unless asked) is our own
continuous-batching runner over llama-cpp-python (.venv-llamacpp's Python, `--llama-cpp-python`), for the one
case no tool covers: the whole workload's output tok/s with more requests than sequences. A baseline whose
Python or tools are absent is skipped with a note. It then writes one result record with a case per
(concurrency, threads): our output tok/s, with each baseline's wall time on the same workload (so `speedup` is
the throughput ratio). Long: minutes per point on a 2-core CPU, dominated by concurrency 1.

`--model` (default: the bundled SmolLM2-135M-Instruct GGUF) names the model every backend runs; the record's
title and raw directory carry its label (`--model-label`, default the file's directory and stem). At
concurrency 1 the case also gives each backend's batch-1 decode rate (1 / median wall time of a decode-only
step, prompt processing excluded) and ours as a percent of the weight-read ceiling. `--prompt-throughput N`
adds, per thread count, a prompt-processing point like llama-bench's ppN: `--num-prompts-pp` prompts of N
tokens, one output token each, one request at a time, measured as prompt tokens / wall time. `--isa avx2`
runs the AVX2 builds of both (KERNEL_LAB_CPU_ISA=avx2, llama.cpp's build-avx2) into a record of its own whose
`isa` field says it emulates an AVX2 machine's ISA choice on this machine, not an AVX2 machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kernel_lab.bench import llama_cpp_tools  # noqa: E402
from kernel_lab.bench.throughput import DEFAULT_LLAMA_CPP_PYTHON, gguf_path, vllm_cpu_env  # noqa: E402
from kernel_lab.harness.bench import Timing, summarize  # noqa: E402
from kernel_lab.harness.results import ResultRecord, slug  # noqa: E402
from kernel_lab.harness.roofline import measure_read_bandwidth  # noqa: E402
from kernel_lab.models.config import ModelConfig  # noqa: E402
from kernel_lab.models.loader import load_config, resolve_model_dir  # noqa: E402

BASELINES = {"transformers": "transformers generate", "vllm": "vLLM CPU (eager)",
             "llama.cpp": "llama.cpp's own tools (llama-bench, llama-batched-bench)",
             "llama.cpp-runner": "llama.cpp through our runner (llama-cpp-python)",
             "kernel-lab-fp32": "kernel-lab, float32 weights", "kernel-lab-ref": "kernel-lab, reference checkout"}
# llama.cpp's tools measure other quantities than a `bench throughput` run (see tool_comparison); the rest run
# `kernel-lab bench throughput --backend ...`.
TOOLS = "llama.cpp"
# Our runner covers the one case no llama.cpp tool runs offline: the whole workload's output tok/s, with
# continuous batching of num_prompts requests over `concurrency` sequences (llama-batched-bench runs exactly B
# sequences at once, llama-bench one). Its raw outputs keep the name they had before the tools came.
RUNNER_CASE = ("the whole workload's output tok/s: num_prompts requests, continuous batching over `concurrency` "
               "sequences, which no llama.cpp tool runs offline")
RAW_PREFIX = {"llama.cpp-runner": "llama.cpp"}
# --isa: the builds an AVX2 machine would run, on this machine.
ISA_NOTE = ("AVX2 builds on this machine (kernel-lab's C kernels with KERNEL_LAB_CPU_ISA=avx2, llama.cpp's "
            "build-avx2): this emulates the ISA choice an AVX2 machine makes, not an AVX2 machine (its clocks, "
            "caches and memory bandwidth are this machine's)")
# The engine's other weight path is a baseline too: it shows which path `weights=auto` should pick here.
ENGINE_VARIANTS = {"kernel-lab-fp32": ["--weights", "float32"]}


# Backends run `--repeats` times per point (the others once): the comparison the targets are about.
REPEATED = ("kernel-lab", "llama.cpp", "llama.cpp-runner", "kernel-lab-ref")


BUNDLED_LABEL = "SmolLM2-135M-Instruct (bundled)"


def raw_name(backend: str, concurrency: int, threads: int, repeat: int = 0, prompt_len: int = 0) -> str:
    point = f"pp{prompt_len}-t{threads}" if prompt_len else f"c{concurrency}-t{threads}"
    return f"{backend}-{point}" + (f"-r{repeat}" if repeat else "") + ".json"


def model_label(model: str | None) -> str:
    if model is None:
        return BUNDLED_LABEL
    path = Path(model)
    return f"{path.parent.name} {path.stem}" if path.is_file() else path.name


def bench(backend: str, concurrency: int, num_prompts: int, input_len: int, output_len: int, out: Path,
          threads: int, python: str = sys.executable, reuse: bool = False, extra_args: list[str] = (),
          model: str | None = None, repo: Path = REPO, isa: str = "native") -> dict:
    if reuse:  # build the record from an earlier run's raw outputs
        result = json.loads(out.read_text())
        expected = {"backend": backend, "concurrency": concurrency, "num_prompts": num_prompts,
                    "input_len": input_len, "output_len": output_len}
        if any(result.get(k) != v for k, v in expected.items()) or result.get("threads") not in (None, threads):
            raise SystemExit(f"{out} does not hold the run {expected | {'threads': threads}}")
        return result
    out = out.resolve()   # the command runs in `repo`, which may be another checkout
    cmd = [python, "-m", "kernel_lab.cli", "bench", "throughput", "--backend", backend,
           "--dataset-name", "fixed", "--num-prompts", str(num_prompts), "--input-len", str(input_len),
           "--output-len", str(output_len), "--max-num-seqs", str(concurrency), "--dtype", "float32",
           "--device", "cpu", "--threads", str(threads), "--output-json", str(out), *extra_args,
           *(["--model", str(model)] if model else [])]
    env = {"TRITON_INTERPRET": "0", "PYTHONPATH": str(repo), "OMP_NUM_THREADS": str(threads),
           **vllm_cpu_env(f"0-{threads - 1}")}
    if backend == "kernel-lab":
        env["KERNEL_LAB_CPU_ISA"] = isa
    subprocess.run(cmd, check=True, cwd=repo, env={**os.environ, **env})
    return json.loads(out.read_text())


def median_run(summaries: list[dict]) -> dict:
    """The run with the median wall time (the lower middle one of an even count), carrying every run's wall
    time in `repeat_elapsed_time`."""
    ordered = sorted(summaries, key=lambda r: r["elapsed_time"])
    return {**ordered[(len(ordered) - 1) // 2], "repeat_elapsed_time": [r["elapsed_time"] for r in summaries]}


def _timing(summary: dict) -> Timing:
    samples = [t * 1e3 for t in summary.get("repeat_elapsed_time", [summary["elapsed_time"]])]
    kind = "whole workload wall clock, " + ("one run" if len(samples) == 1 else
                                            f"{len(samples)} runs in fresh processes, the median run's results")
    return summarize(samples, {"kind": kind, "requests": summary["num_requests"]})


def runs_tok_s(summary: dict) -> list[float]:
    """Output tok/s of each run behind `summary` (one run, or every repeat of a median run)."""
    tokens = summary["output_tokens_per_second"] * summary["elapsed_time"]
    return [tokens / t for t in summary.get("repeat_elapsed_time", [summary["elapsed_time"]])]


def _spread(summary: dict) -> str:
    runs = runs_tok_s(summary)
    return f" (runs {min(runs):.1f}-{max(runs):.1f})" if len(runs) > 1 else ""


def git_commit(checkout) -> str:
    out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def record_title(args) -> str:
    """The record's title, which names its file: one per model, and a before/after run or an --isa avx2 run
    apart from both."""
    title = _base_title(args)
    return title if args.isa == "native" else f"{title} ({args.isa.upper()} builds, emulated on this machine)"


def _base_title(args) -> str:
    if args.reference_checkout:
        return (f"CPU throughput before and after, on {args.model_label or model_label(args.model)}: this "
                f"checkout vs {git_commit(args.reference_checkout)[:10]}")
    if args.model is None:
        return "CPU throughput vs transformers, vLLM CPU and llama.cpp"
    return f"CPU throughput on {args.model_label or model_label(args.model)}"


def fp32_weight_bytes(model: str | None = None) -> int:
    return 4 * ModelConfig.from_hf(load_config(resolve_model_dir(model, float_weights=False))).num_parameters


def decode_rate(summary: dict) -> float | None:
    """Batch-1 decode tok/s of a concurrency-1 run: 1 / median decode-only step (None for older raw outputs)."""
    steps = summary.get("decode_steps")
    return 1e3 / steps["median_ms"] if steps else None


def prompt_rate(summary: dict) -> float:
    return summary["total_prompt_tokens"] / summary["elapsed_time"]


def tool_run(args, c: int, t: int, input_len: int, output_len: int, prompt_len: int, out: Path) -> dict:
    """One run of the llama.cpp tool that covers the point (llama_cpp_tools.measure), kept at `out`: llama-bench
    tg<output_len> at concurrency 1, llama-bench pp<prompt_len> at a prompt-throughput point, else
    llama-batched-bench with B = concurrency."""
    shape = ({"prompt_len": prompt_len, "gen_len": 0, "batch": 0} if prompt_len else
             {"prompt_len": 0, "gen_len": output_len, "batch": 0} if c == 1 else
             {"prompt_len": input_len, "gen_len": output_len, "batch": c})
    if args.reuse_raw:
        result = json.loads(out.read_text())
        if any(result.get(k) != v for k, v in {**shape, "threads": t}.items()):
            raise SystemExit(f"{out} does not hold the run {shape | {'threads': t}}")
        return result
    result = llama_cpp_tools.measure(llama_cpp_tools.find_tools(args.isa), gguf_path(args.model), t, **shape)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def tool_raw_prefix(c: int, prompt_len: int) -> str:
    return "llama-bench" if prompt_len or c == 1 else "llama-batched-bench"


def median_tool_run(tool_runs: list[dict]) -> dict | None:
    """The run with the median tok/s (the lower middle one of an even count), with every run's tok/s."""
    if not tool_runs:
        return None
    ordered = sorted(tool_runs, key=lambda r: r["tok_s"])
    return {**ordered[(len(ordered) - 1) // 2], "runs_tok_s": [r["tok_s"] for r in tool_runs]}


def tool_comparison(ours: dict, tool: dict | None) -> dict | None:
    """Ours against llama.cpp's tool on the quantity the tool measures: batch-1 decode tok/s (our decode-only
    step median) against llama-bench tgN, prompt tok/s against ppN, our total tok/s (prompt + output tokens /
    wall time) against llama-batched-bench's S t/s. None without a tool run (or, at batch 1, our decode steps)."""
    if tool is None:
        return None
    if tool["tool"] == "llama-batched-bench":
        # llama-batched-bench runs its B sequences once; ours runs num_prompts requests through B sequences:
        # the same batch shape, num_prompts / B times over
        ours_tok_s, what = ours["tokens_per_second"], (f"total tok/s: (prompt + output tokens) / wall time, "
                                                       f"{ours['num_prompts']} requests through {tool['batch']} "
                                                       "sequences")
    elif tool["prompt_len"]:
        ours_tok_s, what = prompt_rate(ours), "prompt tok/s: prompt tokens / wall time"
    else:
        ours_tok_s, what = decode_rate(ours), "batch-1 decode tok/s: 1 / median decode-only step"
    if ours_tok_s is None:
        return None
    return {**tool, "kernel_lab_quantity": what, "kernel_lab_tok_s": ours_tok_s, "ratio": ours_tok_s / tool["tok_s"]}


def tool_label(tool: dict) -> str:
    if tool["tool"] == "llama-batched-bench":
        return "llama-batched-bench S t/s"
    return f"llama-bench {'pp' + str(tool['prompt_len']) if tool['prompt_len'] else 'tg' + str(tool['gen_len'])}"


def build_record(runs: dict, args, copy_gbps: float | None = None, prompt_runs: dict | None = None) -> ResultRecord:
    """One record from the runs {(concurrency, threads): (ours, {backend: theirs}, llama.cpp tool run or None)}:
    a case per point, our output tok/s with each baseline's timing, the comparison with llama.cpp's tool
    (`llama_cpp_tool`), and the weight-read bound from the bytes a decode step reads (the engine's stats; the
    fp32 weights when an older raw output lacks them); then a case per prompt throughput point
    {threads: (ours, {backend: theirs}, tool run)}."""
    names = [BASELINES[b] for b in args.backends]
    label = args.model_label or model_label(args.model)
    title = record_title(args)
    record = ResultRecord("09_engine", title, "cpu",
                          description=f"{label}; {args.input_len} prompt + {args.output_len} "
                                      "output tokens per request (the same random ids for every backend, greedy, "
                                      "EOS ignored); kernel-lab: engine defaults (float32 activations, "
                                      "weights=auto: the GGUF's quantized blocks on CPU)"
                                      + (f", extra arguments {shlex.join(args.engine_args)}" if args.engine_args
                                         else "")
                                      + "; transformers: float32 batched generate in groups of `concurrency`, "
                                      "left-padded; vLLM: vllm-cpu LLM.generate, float32, eager, max_num_seqs = "
                                      "concurrency; llama.cpp: its own llama-bench (batch 1: tgN, ppN) and "
                                      "llama-batched-bench (B = concurrency, S t/s against our total tok/s) built "
                                      "from the pinned source (each case's llama_cpp_tool names the build), and "
                                      "where asked our runner over llama-cpp-python (the case no tool covers: "
                                      f"{RUNNER_CASE}); `threads` intra-op threads / cores for each. "
                                      f"Baselines asked for: {', '.join(names) or 'none'}"
                                      + (f"; the reference checkout: {args.reference_checkout} at commit "
                                         f"{git_commit(args.reference_checkout)}" if args.reference_checkout else ""))
    ran = next((ours["cpu_kernels"] for ours, _, _ in runs.values() if "cpu_kernels" in ours), None)
    record.record["isa"] = {"kernel_lab_cpu_isa": args.isa, "llama_cpp_build": args.isa,
                            "emulated": args.isa != "native", **({"note": ISA_NOTE} if args.isa != "native" else {}),
                            **({"kernel_lab_cpu_kernels": ran} if ran else {})}
    copy_gbps = record.ceilings["copy"]["GBps"] if copy_gbps is None else copy_gbps
    ratios, read_bandwidth = {}, {}
    for (c, t), (ours, theirs, tool) in runs.items():
        shape = {"concurrency": c, "threads": t, "num_prompts": ours["num_prompts"], "input_len": args.input_len,
                 "output_len": args.output_len}
        stats = ours.get("engine_stats", {})
        weight_bytes = stats.get("weight_bytes") or fp32_weight_bytes(args.model)
        record.record.setdefault("weight_bytes", weight_bytes)
        # Ceiling: each decode step reads every weight once and yields `c` tokens, so the copy bandwidth bounds
        # output tok/s by c * bandwidth / weight bytes (an upper bound: it ignores prefill and compute).
        bound_tok_s = c * copy_gbps * 1e9 / weight_bytes
        ours_tok_s = ours["output_tokens_per_second"]
        ratios[(c, t)] = {BASELINES[b]: ours_tok_s / r["output_tokens_per_second"] for b, r in theirs.items()}
        extra = {"metric": {"unit": "tok/s", "value": ours_tok_s},
                 "weights": stats.get("weights", "float32"), "weight_bytes": weight_bytes,
                 "baseline_output_tok_s": {BASELINES[b]: r["output_tokens_per_second"] for b, r in theirs.items()},
                 "ratio": ratios[(c, t)],
                 "output_tok_s_runs": {"kernel-lab": runs_tok_s(ours),
                                       **{BASELINES[b]: runs_tok_s(r) for b, r in theirs.items()}},
                 "ceiling": "weight-read bound: concurrency x copy GB/s / bytes of weights a decode step reads",
                 "ceiling_tok_s": bound_tok_s,
                 "percent_of_ceiling": 100.0 * ours_tok_s / bound_tok_s}
        if "llama.cpp-runner" in theirs:
            extra["llama_cpp"] = theirs["llama.cpp-runner"].get("llama_cpp")
            extra["llama_cpp_runner_case"] = RUNNER_CASE
        if (compared := tool_comparison(ours, tool)) is not None:
            extra["llama_cpp_tool"] = compared
            ratios[(c, t)][tool_label(compared)] = compared["ratio"]
        if c == 1 and decode_rate(ours):
            single = copy_gbps * 1e9 / weight_bytes
            if t not in read_bandwidth:
                read_bandwidth[t] = measure_read_bandwidth(t)
            read_bound = read_bandwidth[t]["GBps"] * 1e9 / weight_bytes
            extra["batch1_decode"] = {
                "method": "1 / median wall time of the decode-only steps of the median run (prompt processing "
                          "excluded); ceiling: copy GB/s / bytes of weights one step reads; read ceiling: the "
                          "read bandwidth of `threads` threads / the same bytes (a copy spends half its traffic "
                          "writing, a decode step almost only reads, so it can pass the copy ceiling)",
                "read_bandwidth": read_bandwidth[t], "read_ceiling_tok_s": read_bound,
                "percent_of_read_ceiling": 100.0 * decode_rate(ours) / read_bound,
                "tok_s": {"kernel-lab": decode_rate(ours),
                          **{BASELINES[b]: decode_rate(r) for b, r in theirs.items() if decode_rate(r)}},
                "steps_ms": {"kernel-lab": ours["decode_steps"],
                             **{BASELINES[b]: r["decode_steps"] for b, r in theirs.items() if decode_rate(r)}},
                "ceiling_tok_s": single, "percent_of_ceiling": 100.0 * decode_rate(ours) / single}
        record.add_case(f"output tok/s, concurrency {c}, {t} thread{'s' if t > 1 else ''}", shape=shape,
                        dtype="float32", timing=_timing(ours),
                        baselines={BASELINES[b]: _timing(r) for b, r in theirs.items()}, extra=extra)
        print(f"concurrency {c}, {t} thread(s): kernel-lab {ours_tok_s:.1f} output tok/s{_spread(ours)}; " +
              "; ".join(f"{b} {r['output_tokens_per_second']:.1f}{_spread(r)} ({ratios[(c, t)][BASELINES[b]]:.2f}x)"
                        for b, r in theirs.items()))
        if compared is not None:
            print(f"  {tool_label(compared)}: {compared['tok_s']:.1f} tok/s, kernel-lab "
                  f"{compared['kernel_lab_tok_s']:.1f} ({compared['kernel_lab_quantity']}): {compared['ratio']:.2f}x")
    for t, (ours, theirs, tool) in (prompt_runs or {}).items():
        ours_rate = prompt_rate(ours)
        shape = {"concurrency": 1, "threads": t, "num_prompts": ours["num_prompts"],
                 "input_len": args.prompt_throughput, "output_len": 1}
        ratio = {BASELINES[b]: ours_rate / prompt_rate(r) for b, r in theirs.items()}
        compared = tool_comparison(ours, tool)
        record.add_case(f"prompt tok/s, {args.prompt_throughput}-token prompts, {t} thread{'s' if t > 1 else ''}",
                        shape=shape, dtype="float32", timing=_timing(ours),
                        baselines={BASELINES[b]: _timing(r) for b, r in theirs.items()},
                        extra={"metric": {"unit": "tok/s", "value": ours_rate}, "quantity": "prompt tokens per second",
                               "method": "prompt tokens / wall time; each request runs alone and makes one output "
                                         "token (its prefill and one sampling), like llama-bench's pp",
                               "baseline_prompt_tok_s": {BASELINES[b]: prompt_rate(r) for b, r in theirs.items()},
                               "ratio": ratio, **({"llama_cpp_tool": compared} if compared else {})})
        ratios[("pp", t)] = {**ratio, **({tool_label(compared): compared["ratio"]} if compared else {})}
        print(f"prompt throughput ({args.prompt_throughput}-token prompts), {t} thread(s): kernel-lab "
              f"{ours_rate:.1f} prompt tok/s; " + "; ".join(
                  f"{b} {prompt_rate(r):.1f} ({ratio[BASELINES[b]]:.2f}x)" for b, r in theirs.items()))
    record.set_headline(("" if args.model is None else f"{label}: ") + "tok/s, kernel-lab / baseline: " + "; ".join(
        (f"pp{args.prompt_throughput} t{t}: " if c == "pp" else f"c{c} t{t}: ")
        + (", ".join(f"{r:.2f}x {b}" for b, r in rs.items()) or "no baseline")
        for (c, t), rs in ratios.items()))
    return record


def run_point(args, pythons: dict, raw: Path, c: int, t: int, input_len: int, output_len: int, n: int,
              prompt_len: int = 0) -> tuple[dict, dict, dict | None]:
    """(our median run, {backend: its median run}, llama.cpp's tool's median run or None) at one point;
    kernel-lab and llama.cpp alternate `--repeats` times, the other baselines run once."""
    done = {b: [] for b in ["kernel-lab", *args.backends]}
    for r in range(args.repeats):
        for b in done:
            if r and b not in REPEATED:
                continue
            if b == TOOLS:
                path = raw / raw_name(tool_raw_prefix(c, prompt_len), c, t, r, prompt_len)
                done[b].append(tool_run(args, c, t, input_len, output_len, prompt_len, path))
                continue
            if b == "kernel-lab":
                backend, python, extra = b, sys.executable, args.engine_args
            elif b == "kernel-lab-ref":
                backend, python, extra = "kernel-lab", sys.executable, args.engine_args
            elif b in ENGINE_VARIANTS:
                backend, python, extra = "kernel-lab", sys.executable, [*args.engine_args, *ENGINE_VARIANTS[b]]
            elif b == "llama.cpp-runner":
                backend, python, extra = "llama.cpp", sys.executable, ["--llama-cpp-python", pythons[b]]
            else:
                backend, python, extra = b, pythons[b] if b == "vllm" else sys.executable, []
            path = raw / raw_name(RAW_PREFIX.get(b, b), c, t, r, prompt_len)
            done[b].append(bench(backend, c, n, input_len, output_len, path, t, python, reuse=args.reuse_raw,
                                 extra_args=extra, model=args.model, isa=args.isa,
                                 repo=Path(args.reference_checkout) if b == "kernel-lab-ref" else REPO))
    ours = median_run(done.pop("kernel-lab"))
    tool = median_tool_run(done.pop(TOOLS, []))
    return ours, {b: median_run(v) for b, v in done.items()}, tool


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None,
                        help="a GGUF file or Hugging Face directory for every backend (default: the bundled model)")
    parser.add_argument("--model-label", default=None, help="the model's name in the record (default: from the path)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-prompts-c1", type=int, default=8,
                        help="prompts at concurrency 1 (each runs alone, so fewer keep the run short)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}),
                        help="intra-op threads / cores of every backend, one run per value (default: 1 and all)")
    listed = [b for b in BASELINES if b != "kernel-lab-ref"]  # that one comes with --reference-checkout
    parser.add_argument("--backends", nargs="*", default=[b for b in listed if b != "llama.cpp-runner"],
                        choices=listed, help="baselines to run beside kernel-lab (default: all but llama.cpp-runner "
                                             "whose Python or tools are present)")
    parser.add_argument("--isa", default="native", choices=list(llama_cpp_tools.BUILDS),
                        help="avx2: our C kernels built for AVX2 (KERNEL_LAB_CPU_ISA=avx2) and llama.cpp's AVX2 "
                             "build, on this machine; the record says it emulates the ISA choice, not the machine")
    parser.add_argument("--prompt-throughput", type=int, default=0, metavar="N",
                        help="also measure prompt throughput on N-token prompts (like llama-bench's ppN)")
    parser.add_argument("--num-prompts-pp", type=int, default=4, help="prompts per prompt-throughput point")
    parser.add_argument("--engine-args", default="",
                        help="extra `kernel-lab bench throughput` arguments for our engine, one string")
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"),
                        help="a Python with vllm installed (project 08's environment); skipped if absent")
    parser.add_argument("--llama-cpp-python", default=str(DEFAULT_LLAMA_CPP_PYTHON),
                        help="a Python with llama_cpp for llama.cpp-runner (.venv-llamacpp, `make llama-cpp-env`); "
                             "skipped if absent")
    parser.add_argument("--repeats", type=int, default=3,
                        help=f"runs per point of {' and '.join(REPEATED)} (the others run once)")
    parser.add_argument("--reference-checkout", default=None, metavar="DIR",
                        help="another checkout of this repository (e.g. a git worktree of an earlier commit): its "
                             "engine runs as the baseline 'kernel-lab, reference checkout', alternating with ours, "
                             "for a before/after comparison in one session")
    parser.add_argument("--reuse-raw", action="store_true",
                        help="do not run: rebuild the record from the raw outputs of an earlier run")
    parser.add_argument("--out", default=str(REPO / "results"))
    args = parser.parse_args(argv)
    args.engine_args = shlex.split(args.engine_args)
    raw = Path(args.out) / "09_engine" / "raw"
    if args.reference_checkout or args.isa != "native":
        raw = raw / slug(record_title(args))
    elif args.model is not None:
        raw = raw / slug(args.model_label or model_label(args.model))
    raw.mkdir(parents=True, exist_ok=True)
    pythons = {"transformers": sys.executable, "vllm": args.vllm_python, "llama.cpp-runner": args.llama_cpp_python,
               "kernel-lab-fp32": sys.executable, "kernel-lab-ref": sys.executable}
    if args.reference_checkout:
        args.backends = [*args.backends, "kernel-lab-ref"]
    present = []
    for b in args.backends:
        if b == TOOLS:
            why = None if args.reuse_raw else llama_cpp_tools.missing(args.isa, ("llama-bench", "llama-batched-bench"))
            if why:
                print(f"note: skipping {b}: {why}")
            else:
                present.append(b)
        elif args.reuse_raw or Path(pythons[b]).exists():
            present.append(b)
        else:
            print(f"note: skipping {b}: no Python at {pythons[b]}" +
                  (" (make llama-cpp-env)" if b == "llama.cpp-runner" else " (make plugin-test builds .venv-vllm)"
                   if b == "vllm" else ""))
    args.backends = present
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    runs = {}
    for c in args.concurrency:
        for t in args.threads:
            runs[(c, t)] = run_point(args, pythons, raw, c, t, args.input_len, args.output_len,
                                     args.num_prompts_c1 if c == 1 else args.num_prompts)
    prompt_runs = {t: run_point(args, pythons, raw, 1, t, args.prompt_throughput, 1, args.num_prompts_pp,
                                prompt_len=args.prompt_throughput)
                   for t in (args.threads if args.prompt_throughput else [])}
    build_record(runs, args, prompt_runs=prompt_runs).emit(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
