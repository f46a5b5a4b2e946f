"""Project 08 benchmark: the plugin's SiluAndMul against vLLM's, alone and inside a running engine.

    python projects/08_vllm_plugin/benchmark_operator.py [--quick] [--out DIR] [--model DIR] [--no-e2e]

Needs a CUDA GPU and vLLM (any CUDA machine with `pip install vllm`); otherwise it says so and exits 0.
The plugin need not be installed: this directory is put on the path, and the engine runs in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so the plugin is registered by calling `register()`.

1. Operator: `torch.ops.kernel_lab.silu_and_mul` (and the plain `kernel_lab.ops.silu_and_mul`) against
   vLLM's CUDA kernel `torch.ops._C.silu_and_mul`, bf16. Bytes per call: 3 * tokens * d * 2; GB/s is
   reported as % of the copy bandwidth measured on the same device.
2. End to end: one fresh process per arm, same model, same prompts (fixed token ids), greedy:
   - stock:    vLLM as shipped (compiled; custom ops off, so Inductor generates the activation),
   - stock_op: vLLM with its own CUDA op enabled (custom_ops=["+silu_and_mul"]),
   - plugin:   this plugin, enabled (custom_ops=["+SiluAndMul"]).
   Throughput: a batch of prompts, output tokens per second. Latency: one request at a time, ms per
   output token. The speedup column is arm time / plugin time (> 1: the plugin is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

PROJECT = "08_vllm_plugin"
ARM_CUSTOM_OPS = {"stock": None, "stock_op": ["+silu_and_mul"], "plugin": ["+SiluAndMul"]}


def _available() -> str | None:
    """None when this benchmark can run here, else the reason it cannot."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vLLM is not installed"
    return None


# ------------------------------------------------------------------------------------------------ operator
def operator_sweep(quick: bool) -> list[tuple[int, int]]:
    widths = (8960, 14336) if quick else (1536, 8960, 11008, 14336, 18944)
    tokens = (1, 16, 4096, 32768) if quick else (1, 16, 128, 1024, 4096, 16384, 32768)
    return [(t, d) for d in widths for t in tokens]


def run_operator(quick: bool, out: str | None):
    import torch
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    from kernel_lab_vllm_plugin import ops  # noqa: F401  (registers torch.ops.kernel_lab.silu_and_mul)

    from kernel_lab.harness.bench import benchmark, inputs_for_rotation
    from kernel_lab.harness.results import ResultRecord
    from kernel_lab.ops import silu_and_mul

    device = torch.device("cuda")
    dtype = torch.bfloat16
    rec = ResultRecord(PROJECT, "silu_and_mul vs vllm", device,
                       "plugin operator torch.ops.kernel_lab.silu_and_mul vs vLLM's torch.ops._C.silu_and_mul, "
                       "bf16; GB/s = 3 * tokens * d * 2 bytes; small calls timed as CUDA-graph replays")
    with torch.no_grad():
        for tokens, d in operator_sweep(quick):
            nbytes = 3 * tokens * d * 2
            xs = [torch.randn(tokens, 2 * d, device=device, dtype=dtype) for _ in range(inputs_for_rotation(nbytes))]
            outs = [torch.empty(tokens, d, device=device, dtype=dtype) for _ in xs]
            label = f"tokens={tokens} d={d}"
            t_op = benchmark([lambda x=x: torch.ops.kernel_lab.silu_and_mul(x) for x in xs], device=device,
                             name=f"plugin op {label}")
            t_vllm = benchmark([lambda x=x, o=o: torch.ops._C.silu_and_mul(o, x) for x, o in zip(xs, outs)],
                               device=device, name=f"vllm op {label}")
            t_plain = benchmark([lambda x=x, o=o: silu_and_mul(x, out=o) for x, o in zip(xs, outs)],
                                device=device, name=f"kernel_lab op {label}")
            rec.add_case(f"plugin op {label}", shape={"tokens": tokens, "d": d}, dtype="bf16", timing=t_op,
                         nbytes=nbytes, baselines={"vllm _C.silu_and_mul": t_vllm, "kernel_lab.ops (out=)": t_plain})
            del xs, outs
    large = [c for c in rec.record["cases"] if c["shape"]["tokens"] * c["shape"]["d"] >= 32 * 2**20]
    if large:
        worst = min(large, key=lambda c: c["percent_of_ceiling"])
        rec.set_headline(f"plugin silu_and_mul bf16, tokens*d >= 32M: worst case {worst['percent_of_ceiling']:.1f}% "
                         f"of measured copy bandwidth ({worst['name']})",
                         percent_of_ceiling=worst["percent_of_ceiling"],
                         speedup=min(c["speedup"]["vllm _C.silu_and_mul"] for c in large),
                         baseline="vllm _C.silu_and_mul")
    print(rec.table())
    path = rec.write(out)
    if path:
        print(f"wrote {path}")
    return rec


# ------------------------------------------------------------------------------------------------ end to end
def e2e_worker(arm: str, spec_path: str, out_path: str) -> None:
    """One engine, one arm: warm up, then time a throughput batch and single-request latency."""
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams

    if arm == "plugin":
        import kernel_lab_vllm_plugin

        kernel_lab_vllm_plugin.register()
    kwargs = dict(model=spec["model"], dtype=spec["dtype"], seed=0, max_model_len=spec["max_model_len"],
                  gpu_memory_utilization=spec["gpu_memory_utilization"])
    if ARM_CUSTOM_OPS[arm] is not None:
        kwargs["compilation_config"] = {"custom_ops": ARM_CUSTOM_OPS[arm]}
    started = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - started

    def act_classes(model):
        from vllm.model_executor.layers.activation import SiluAndMul

        return sorted({f"{type(m).__qualname__}:{getattr(m._forward_method, '__name__', '?')}"
                       for m in model.modules() if isinstance(m, SiluAndMul)})

    prompts = [{"prompt_token_ids": ids} for ids in spec["prompt_token_ids"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_tokens"], ignore_eos=True)
    llm.generate(prompts[: min(8, len(prompts))], params, use_tqdm=False)  # warm-up

    batch_s = []
    for _ in range(spec["repeats"]):
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        batch_s.append(time.perf_counter() - t0)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    single_s = []
    for ids in prompts[: spec["latency_requests"]]:
        t0 = time.perf_counter()
        llm.generate([ids], params, use_tqdm=False)
        single_s.append(time.perf_counter() - t0)
    Path(out_path).write_text(json.dumps({
        "arm": arm, "startup_s": startup_s, "batch_s": batch_s, "generated_tokens": generated,
        "single_s": single_s, "output_tokens": spec["output_tokens"],
        "first_tokens": [list(o.outputs[0].token_ids[:8]) for o in outputs[:4]],
        "act_fns": llm.apply_model(act_classes)[0],
    }))


def run_e2e(quick: bool, out: str | None, model: str | None, arms: list[str], dtype: str):
    import random

    import torch

    if model is None:
        from kernel_lab.models.gguf import export_hf_directory

        model = str(export_hf_directory())
    rng = random.Random(0)
    num_prompts, prompt_len, output_tokens = (64, 128, 128) if quick else (256, 256, 256)
    spec = {"model": model, "dtype": dtype, "max_model_len": prompt_len + output_tokens + 16,
            "gpu_memory_utilization": 0.6, "output_tokens": output_tokens, "repeats": 2 if quick else 3,
            "latency_requests": 3 if quick else 8,
            # Fixed token ids (avoiding the special ids at the bottom of the vocabulary): every arm
            # processes exactly the same work, whatever the tokenizer.
            "prompt_token_ids": [[rng.randrange(100, 30000) for _ in range(prompt_len)] for _ in range(num_prompts)]}
    reports = {}
    with tempfile.TemporaryDirectory() as work:
        spec_path = Path(work) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for arm in arms:
            out_path = Path(work) / f"{arm}.json"
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
            if arm != "plugin":
                env["VLLM_PLUGINS"] = ""  # even if the plugin is installed, the stock arms must not load it
            print(f"== e2e arm {arm}", flush=True)
            proc = subprocess.run([sys.executable, __file__, "--e2e-worker", arm, str(spec_path), str(out_path)],
                                  env=env, timeout=900)
            if proc.returncode != 0 or not out_path.exists():
                print(f"e2e arm {arm} failed (rc={proc.returncode})")
                continue
            reports[arm] = json.loads(out_path.read_text())
            print(f"   {arm}: start-up {reports[arm]['startup_s']:.0f} s, SiluAndMul: {reports[arm]['act_fns']}")
    if "plugin" not in reports:
        print("the plugin arm did not finish; no end-to-end record")
        return None

    meta = {"model": Path(model).name, "dtype": dtype, "prompts": num_prompts, "prompt_len": prompt_len,
            "output_tokens": output_tokens}
    rec = e2e_record(reports, meta, torch.device("cuda"))
    print(rec.table())
    path = rec.write(out)
    if path:
        print(f"wrote {path}")
    return rec


def e2e_record(reports: dict, meta: dict, device):
    """The end-to-end result record from the arms' reports (the plugin arm is the measured case, the
    other arms its baselines)."""
    from kernel_lab.harness.bench import summarize
    from kernel_lab.harness.results import ResultRecord

    n, output_tokens = meta["prompts"], meta["output_tokens"]
    rec = ResultRecord(PROJECT, "vllm end to end", device,
                       f"vLLM generate, {meta['model']} {meta['dtype']}, greedy, {n} prompts x {meta['prompt_len']} "
                       f"tokens -> {output_tokens} tokens each; plugin (+SiluAndMul) vs stock vLLM arms")

    def timing(samples_s, what):
        return summarize([s * 1e3 for s in samples_s], {"timer": "time.perf_counter around LLM.generate",
                                                         "what": what})

    others = {arm: r for arm, r in reports.items() if arm != "plugin"}
    plugin = reports["plugin"]
    tput = {arm: r["generated_tokens"] / min(r["batch_s"]) for arm, r in reports.items()}
    ms_per_token = {arm: 1e3 * sorted(r["single_s"])[len(r["single_s"]) // 2] / output_tokens
                    for arm, r in reports.items()}
    rec.add_case(f"throughput batch={n}", shape={"prompts": n, "prompt_len": meta["prompt_len"],
                 "output_tokens": output_tokens}, dtype=meta["dtype"], timing=timing(plugin["batch_s"], "whole batch"),
                 baselines={arm: timing(r["batch_s"], "whole batch") for arm, r in others.items()},
                 extra={"metric": {"unit": "tok/s", "value": tput["plugin"]}, "output_tokens_per_s": tput})
    rec.add_case("latency batch=1", shape={"prompt_len": meta["prompt_len"], "output_tokens": output_tokens},
                 dtype=meta["dtype"], timing=timing(plugin["single_s"], "one request"),
                 baselines={arm: timing(r["single_s"], "one request") for arm, r in others.items()},
                 extra={"metric": {"unit": "ms", "value": ms_per_token["plugin"]}, "ms_per_output_token": ms_per_token})
    if "stock" in reports:
        ratio = tput["plugin"] / tput["stock"]
        rec.set_headline(f"vLLM end to end, plugin vs stock: {ratio:.3f}x output tokens/s at batch {n}, "
                         f"{ms_per_token['plugin']:.2f} vs {ms_per_token['stock']:.2f} ms per token at batch 1",
                         speedup=ratio, baseline="stock")
    for arm in reports:
        print(f"   {arm:9s} {tput[arm]:9.1f} output tok/s   {ms_per_token[arm]:7.2f} ms/token at batch 1")
    return rec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller sweep and a shorter end-to-end run")
    parser.add_argument("--out", help="directory to write JSON result records into (e.g. results)")
    parser.add_argument("--model", help="a local Hugging Face model directory (default: the bundled SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--arms", default=None, help="comma-separated: stock,stock_op,plugin "
                        "(default: all three; --quick: stock,plugin)")
    parser.add_argument("--no-e2e", action="store_true", help="operator benchmark only")
    parser.add_argument("--no-op", action="store_true", help="end-to-end benchmark only")
    parser.add_argument("--e2e-worker", nargs=3, metavar=("ARM", "SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.e2e_worker:
        e2e_worker(*args.e2e_worker)
        return 0
    reason = _available()
    if reason is not None:
        print(f"benchmark_operator.py: skipped ({reason}); it needs a CUDA GPU and vLLM")
        return 0
    if not args.no_op:
        run_operator(args.quick, args.out)
    if not args.no_e2e:
        arms = args.arms.split(",") if args.arms else (["stock", "plugin"] if args.quick else list(ARM_CUSTOM_OPS))
        unknown = set(arms) - set(ARM_CUSTOM_OPS)
        if unknown or "plugin" not in arms:
            parser.error(f"--arms must name known arms ({', '.join(ARM_CUSTOM_OPS)}) and include plugin")
        run_e2e(args.quick, args.out, args.model, arms, args.dtype)
    return 0


if __name__ == "__main__":  # vLLM may spawn processes that re-import this module
    raise SystemExit(main())
