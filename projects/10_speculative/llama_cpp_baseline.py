"""Project 10 against llama.cpp's own speculative decoding, batch 1, on CPU: our engine with and without
speculation, and llama.cpp's llama-lookup / llama-speculative with and without drafts, on the same prompts.

    python projects/10_speculative/llama_cpp_baseline.py [--proposer ngram|draft] [--reps 3] [--threads N]
        [--max-tokens 192] [--k 4] [--out results]

The workloads are engine_benchmark.py's: rewrite (code in the prompt), quote (a passage in the prompt) and
chat, each prompt rendered by the model's chat template. Every prompt is one request at a time (llama.cpp's
examples decode one sequence), greedy, EOS honoured, up to --max-tokens.
- `ngram`: the bundled SmolLM2-135M-Instruct GGUF (Q4_1). Ours: n-gram prompt lookup (1..4, k drafts)
  against the same engine without it. llama.cpp: `llama-lookup --spec-draft-n-max k` against
  `llama-lookup --spec-draft-n-max 0` (the same program drafting nothing).
- `draft`: the float32 weights as target, the Q4_1 GGUF as draft. Ours: the draft-model proposer against
  float32 alone. llama.cpp: `llama-speculative -m F32 -md Q4_1 --spec-draft-n-max k` against
  `llama-lookup --spec-draft-n-max 0 -m F32`. The F32 GGUF is made once by llama.cpp's converter
  (`make llama-cpp-converter`) from the same float32 checkpoint our engine loads.
A repetition runs every workload on the four configurations, alternating their order. Figure per
configuration: output tokens / seconds, where seconds are our engine's wall clock from a request's arrival to
its finish, and llama.cpp's logged prompt (`encoded`) plus generation (`decoded`) time (its model load is
not counted, nor is ours). llama.cpp runs with flash attention off (`-fa off`): its default (auto) decoded
at half the speed here (llama_cpp_tools.speculation_command). The tools are built by `make llama-cpp-env`
from the pinned source; the record names their build.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

F32_GGUF = Path(os.environ.get("KERNEL_LAB_CACHE", Path.home() / ".cache" / "kernel_lab")) / "models" / \
    "smollm2-135m-instruct-f32.gguf"
CONVERTER = REPO / ".llama-cpp-converter" / "convert_hf_to_gguf.py"


def float32_gguf(checkpoint: Path) -> Path:
    """The float32 checkpoint as an F32 GGUF, by llama.cpp's converter (once; reused while it exists)."""
    if F32_GGUF.exists():
        return F32_GGUF
    if not CONVERTER.exists():
        raise FileNotFoundError(f"no llama.cpp converter at {CONVERTER}: run `make llama-cpp-converter`")
    F32_GGUF.parent.mkdir(parents=True, exist_ok=True)
    tmp = F32_GGUF.with_suffix(".tmp")
    result = subprocess.run([sys.executable, str(REPO / "projects" / "09_engine" / "convert_with_llama_cpp.py"),
                             str(CONVERTER)], input=f'["{checkpoint}", "{tmp}"]\n', capture_output=True, text=True)
    if result.returncode != 0 or result.stdout.strip() != "null":
        raise RuntimeError(f"converting {checkpoint} failed: {result.stdout.strip()} {result.stderr[-2000:]}")
    tmp.rename(F32_GGUF)
    return F32_GGUF


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--proposer", choices=("ngram", "draft"), default="ngram")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--k", type=int, default=4, help="drafts per step (num_speculative_tokens, -n-max)")
    parser.add_argument("--out", default=None, help="results directory for the record (e.g. results)")
    parser.add_argument("--note", default="", help="appended to the record's description (e.g. machine load)")
    args = parser.parse_args(argv)

    import torch
    from engine_benchmark import run_point, workloads

    from kernel_lab.bench import llama_cpp_tools as tools_mod
    from kernel_lab.engine import LLMEngine
    from kernel_lab.harness.bench import summarize
    from kernel_lab.harness.results import ResultRecord
    from kernel_lab.models.gguf import default_model_path
    from kernel_lab.models.loader import resolve_model_dir

    torch.set_num_threads(args.threads)
    tools = tools_mod.find_tools("native")
    quantized = Path(default_model_path())
    if args.proposer == "ngram":
        weights, target_gguf = "auto", quantized
        spec_config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 1}
        spec_tool, draft_gguf = "llama-lookup", None
    else:
        weights, target_gguf = "float32", float32_gguf(resolve_model_dir(None, float_weights=True))
        spec_config = {"model": str(quantized), "num_speculative_tokens": args.k, "weights": "quantized"}
        spec_tool, draft_gguf = "llama-speculative", quantized
    common = dict(device="cpu", weights=weights, max_num_seqs=1)
    ours = {"ours": LLMEngine(None, **common), "ours, speculating": LLMEngine(None, speculative_config=spec_config,
                                                                            **common)}
    tokenizer = ours["ours"].tokenizer
    texts = {w: [tokenizer.render_chat([{"role": "user", "content": p}]) for p in ps] for w, ps in workloads().items()}
    ids = {w: [tokenizer.encode(t, add_special_tokens=False) for t in ts] for w, ts in texts.items()}
    tmp = tempfile.TemporaryDirectory()
    files = {}
    for w, ts in texts.items():
        for i, t in enumerate(ts):
            files[w, i] = Path(tmp.name) / f"{w}{i}.txt"
            files[w, i].write_text(t)

    def llama(workload: str, draft_max: int) -> tuple[float, int, dict]:
        tool = spec_tool if draft_max else "llama-lookup"
        seconds, tokens, counts = 0.0, 0, {"drafted": 0, "accepted": 0}
        for i in range(len(texts[workload])):
            got = tools_mod.run_speculation(tools_mod.speculation_command(
                tools.path(tool), target_gguf, files[workload, i], args.max_tokens, args.threads, draft_max,
                draft_gguf if draft_max else None))
            seconds += got["prompt_s"] + got["decode_s"]
            tokens += got["tokens"]
            for key in counts:
                counts[key] += got[key]
        return seconds, tokens, counts

    configs = {"ours": lambda w: run_point(ours["ours"], ids[w], 1, args.max_tokens)[:2] + ({},),
               "ours, speculating": lambda w: run_point(ours["ours, speculating"], ids[w], 1, args.max_tokens)[:2]
               + ({},),
               "llama.cpp": lambda w: llama(w, 0),
               "llama.cpp, speculating": lambda w: llama(w, args.k)}
    for engine in ours.values():     # warm-up
        run_point(engine, ids["chat"][:1], 1, 8)
    ms = {(w, c): [] for w in texts for c in configs}
    counts = {w: {"drafted": 0, "accepted": 0} for w in texts}
    for rep in range(args.reps):
        for w in texts:
            order = list(configs) if rep % 2 == 0 else list(configs)[::-1]
            for c in order:
                seconds, tokens, got = configs[c](w)
                ms[w, c].append(seconds * 1e3 / tokens)
                for key, value in got.items():
                    counts[w][key] += value
            print(f"rep {rep} {w}: " + ", ".join(f"{c} {1e3 / ms[w, c][-1]:.1f} tok/s" for c in configs), flush=True)

    what = {"ngram": f"n-gram prompt lookup, k={args.k}", "draft": f"Q4_1 draft for the float32 target, k={args.k}"}
    record = ResultRecord(
        "10_speculative", f"speculative decoding against llama.cpp's {spec_tool}, batch 1 ({args.proposer})", "cpu",
        ceilings_record={},
        description=f"Bundled SmolLM2-135M-Instruct; {what[args.proposer]}; greedy, EOS honoured, up to "
                    f"{args.max_tokens} tokens, one request at a time, {args.threads} thread(s); workloads rewrite, "
                    f"quote, chat (engine_benchmark.py's prompts, chat template applied). Ours: kernel-lab's engine "
                    f"with and without speculation (wall clock per request). llama.cpp: {spec_tool} "
                    f"--spec-draft-n-max {args.k} and llama-lookup --spec-draft-n-max 0, -fa off, on "
                    f"{target_gguf.name}{' with ' + quantized.name + ' drafting' if draft_gguf else ''} (logged prompt "
                    f"+ generation seconds). {args.reps} alternating repetitions. " + args.note)
    method = {"kind": "seconds per workload / output tokens", "reps": args.reps, "alternating": True}
    headline = {}
    for w in texts:
        timing = {c: summarize(ms[w, c], method) for c in configs}
        acceptance = counts[w]["accepted"] / counts[w]["drafted"] if counts[w]["drafted"] else None
        case = record.add_case(
            f"{w}, batch 1", shape={"workload": w, "prompts": len(texts[w]), "max_tokens": args.max_tokens,
                                    "threads": args.threads, "k": args.k},
            dtype="quantized" if args.proposer == "ngram" else "float32", timing=timing["ours, speculating"],
            baselines={c: timing[c] for c in configs if c != "ours, speculating"},
            extra={"metric": {"unit": "tok/s", "value": 1e3 / timing["ours, speculating"].median_ms},
                   "tok_s": {c: 1e3 / timing[c].median_ms for c in configs},
                   "our_speculation_speedup": timing["ours"].median_ms / timing["ours, speculating"].median_ms,
                   "llama_cpp_speculation_speedup": timing["llama.cpp"].median_ms
                   / timing["llama.cpp, speculating"].median_ms,
                   "llama_cpp_drafted": counts[w]["drafted"], "llama_cpp_accepted": counts[w]["accepted"],
                   "llama_cpp_acceptance": acceptance,
                   "baseline_tools": {"llama.cpp": tools.provenance("llama-lookup"),
                                      "llama.cpp, speculating": tools.provenance(spec_tool)}})
        headline[f"{w}_vs_llama_cpp_speculating"] = case["speedup"]["llama.cpp, speculating"]
        print(f"{w}: ours speculating {1e3 / timing['ours, speculating'].median_ms:.1f} tok/s, "
              f"{case['speedup']['llama.cpp, speculating']:.2f}x llama.cpp speculating; speculation gains ours "
              f"{case['our_speculation_speedup']:.2f}x, llama.cpp {case['llama_cpp_speculation_speedup']:.2f}x "
              f"(acceptance {acceptance})")
    record.set_headline(f"ours speculating vs llama.cpp's {spec_tool}: " + ", ".join(
        f"{k.split('_vs_')[0]} {v:.2f}x" for k, v in headline.items()), **headline)
    record.emit(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
