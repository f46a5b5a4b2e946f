"""Batch-1 decode at long context on CPU: the engine in each KV page format against llama.cpp's own
llama-bench at the same depth with its f16 and q8_0 caches (issue 35 item 4).

    python projects/09_engine/long_context_decode.py --model FILE.gguf [--depths 1024 4096 8192]
        [--threads 2] [--gen 32] [--formats float32 float16 int8] [--cache-types f16 q8_0] [--out results]

A point is a depth D and a thread count. Ours: `kernel-lab bench throughput` with one request of D random
prompt tokens and `--gen` output tokens, `--max-num-seqs 1`, the KV pages in each `--kv-cache-dtype`; the
figure is 1 / the median decode-only step (the prompt's prefill is not timed), as cpu_throughput.py takes
batch-1 decode. llama.cpp: `llama-bench -p 0 -n GEN -d D -ctk T -ctv T -t N` (flash attention at its
default, auto), built from the pinned source by `make llama-cpp-env`; avg_ts is its decode tok/s after the
depth. The two alternate within a point (ours in every format, then llama.cpp in every cache type). The
pairs compared are the issue's: float16 pages (the CPU default) against f16, int8 against q8_0; float32
against f16 too. One repetition per configuration: each costs a D-token prefill.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from cpu_throughput import bench, decode_rate, model_label  # noqa: E402

from kernel_lab.bench import llama_cpp_tools  # noqa: E402
from kernel_lab.bench.throughput import gguf_path  # noqa: E402
from kernel_lab.harness.bench import Timing  # noqa: E402
from kernel_lab.harness.results import ResultRecord  # noqa: E402

PAIRS = {"float32": "f16", "float16": "f16", "bfloat16": "f16", "int8": "q8_0"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the GGUF file both engines run (e.g. make_1b_gguf.py's)")
    parser.add_argument("--depths", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--formats", nargs="+", default=["float32", "float16", "int8"], choices=list(PAIRS))
    parser.add_argument("--cache-types", nargs="+", default=["f16", "q8_0"])
    parser.add_argument("--isa", default="native", help="the llama.cpp build (native or avx2) and our ISA path")
    parser.add_argument("--out")
    parser.add_argument("--note", default="")
    parser.add_argument("--label", default="", help="added to the record's name, so a run of other points does not "
                        "replace an earlier record on the same machine")
    args = parser.parse_args(argv)
    model = gguf_path(args.model)
    tools = llama_cpp_tools.find_tools(args.isa)
    record = ResultRecord("09_engine", f"cpu long-context batch-1 decode on {model_label(str(model))}"
                          + (f", {args.label}" if args.label else ""), "cpu",
                          f"batch-1 decode tok/s after D context tokens, {args.gen} generated; ours (1 / median "
                          "decode-only step, kernel-lab bench throughput) per KV page format against "
                          f"llama-bench -d D -ctk/-ctv per cache type, alternating, one run each. {args.note}".strip(),
                          ceilings_record={})
    with tempfile.TemporaryDirectory() as tmp:
        for depth in args.depths:
            for threads in args.threads:
                ours = {}
                for fmt in args.formats:
                    summary = bench("kernel-lab", 1, 1, depth, args.gen, Path(tmp) / f"{fmt}-{depth}-{threads}.json",
                                    threads, model=str(model), isa=args.isa,
                                    extra_args=["--kv-cache-dtype", fmt, "--max-model-len", str(depth + args.gen)])
                    ours[fmt] = (decode_rate(summary), summary)
                    print(f"depth {depth} threads {threads} ours {fmt}: {ours[fmt][0]:.2f} tok/s", flush=True)
                theirs = {}
                for cache_type in args.cache_types:
                    theirs[cache_type] = llama_cpp_tools.measure(tools, model, threads, gen_len=args.gen, depth=depth,
                                                                 cache_type=cache_type)
                    print(f"depth {depth} threads {threads} llama-bench {cache_type}: "
                          f"{theirs[cache_type]['tok_s']:.2f} tok/s", flush=True)
                for fmt, (rate, summary) in ours.items():
                    timing = Timing(**summary["decode_steps"])
                    pair = PAIRS[fmt]
                    baselines = {}
                    extra = {"tok_s": rate, "llama_bench": {k: {kk: v[kk] for kk in ("tok_s", "command", "quantity")}
                                                            for k, v in theirs.items()}}
                    if pair in theirs:
                        their_ms = 1e3 / theirs[pair]["tok_s"]
                        baselines[f"llama-bench {pair} cache"] = Timing(
                            their_ms, their_ms, their_ms, their_ms, args.gen,
                            {"kind": "llama-bench avg_ts over its repetition: a mean, no spread"})
                    record.add_case(f"{fmt} pages depth={depth} threads={threads}",
                                    shape={"depth": depth, "gen": args.gen, "threads": threads, "batch": 1},
                                    dtype=fmt, timing=timing, baselines=baselines, extra=extra)
    record.record["llama_cpp"] = {k: v for k, v in next(iter(theirs.values())).items()
                                  if k not in ("output", "command", "tok_s", "quantity")} if args.cache_types else {}
    print(record.table())
    record.write(args.out)
    print(json.dumps({c["name"]: round(c["tok_s"], 2) for c in record.record["cases"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
