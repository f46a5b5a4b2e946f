"""One vLLM start-up: greedy generation plus evidence of which SiluAndMul ran, written as JSON.

    python vllm_generate.py SPEC.json OUT.json

SPEC: {"model": dir, "prompts": [...], "max_tokens": int, "mode": "eager"|"compiled",
       "custom_ops": [...] or null, "plugin": bool}

The caller sets the environment before this process starts (vLLM reads it at import): VLLM_PLUGINS=""
for the stock run, VLLM_ENABLE_V1_MULTIPROCESSING=0 so the engine and its worker live in this process
(the counters below are plain Python), TRITON_INTERPRET=1 to run the Triton kernel through the interpreter.

Evidence gathered in plugin runs:
- every stock SiluAndMul forward, and the replacement's own forward_native, is replaced by a function that
  raises, so a run in which any of them executes (or is traced by torch.compile) fails;
- calls into `kernel_lab.ops.silu_and_mul` (the eager path), launches of project 02's Triton kernel
  (`swiglu._launch`), and calls of the reference math from inside the op's traced body (compiled mode).
"""

from __future__ import annotations

import json
import sys
import time


class StockOpRan(RuntimeError):
    pass


def _stock_ran(*args, **kwargs):
    raise StockOpRan("a stock SiluAndMul forward ran although the plugin replaces it")


def _counting(counts: dict, key: str, fn, rows_key: str | None = None):
    def wrapper(x, *args, **kwargs):
        counts[key] += 1
        if rows_key is not None:
            counts[rows_key] += x.numel() // x.shape[-1]
        return fn(x, *args, **kwargs)

    return wrapper


def install_probes(plugin: bool) -> dict:
    counts = {"public_op_calls": 0, "public_op_rows": 0, "triton_launches": 0, "traced_body_calls": 0}
    if not plugin:
        return counts
    from kernel_lab_vllm_plugin.layer import KernelLabSiluAndMul
    from vllm.model_executor.layers.activation import SiluAndMul

    import kernel_lab.ops as kernel_lab_ops
    from kernel_lab.ops import swiglu

    kernel_lab_ops.silu_and_mul = _counting(counts, "public_op_calls", kernel_lab_ops.silu_and_mul, "public_op_rows")
    swiglu._launch = _counting(counts, "triton_launches", swiglu._launch)
    # In plugin runs the reference is reached only from the triton_op body (forward_native is disabled
    # below), i.e. when torch.compile traces the op on CPU.
    swiglu.silu_and_mul_reference = _counting(counts, "traced_body_calls", swiglu.silu_and_mul_reference)
    for name in ("forward_native", "forward_cpu", "forward_cuda", "forward_xpu"):
        setattr(SiluAndMul, name, staticmethod(_stock_ran))
    KernelLabSiluAndMul.forward_native = staticmethod(_stock_ran)
    return counts


def describe_act_fns(worker) -> dict:
    """Runs inside the worker (in this process): the SiluAndMul modules vLLM actually built."""
    from vllm.model_executor.layers.activation import SiluAndMul

    compilation = worker.vllm_config.compilation_config
    layers = [m for m in worker.get_model().modules() if isinstance(m, SiluAndMul)]
    return {
        "custom_ops": list(compilation.custom_ops),
        "mode": int(compilation.mode),
        "enabled_custom_ops": sorted(compilation.enabled_custom_ops),
        "disabled_custom_ops": sorted(compilation.disabled_custom_ops),
        "count": len(layers),
        "classes": sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in layers}),
        "op_names": sorted({type(m).name for m in layers}),
        "forward_methods": sorted({getattr(m._forward_method, "__qualname__", repr(m._forward_method))
                                   for m in layers}),
    }


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    started = time.perf_counter()
    from vllm import LLM, SamplingParams

    # The engine loads the plugin itself (after configuring logging); the probes only need the classes.
    counts = install_probes(spec["plugin"])

    # A small token budget: the prompts are short, and compiled mode warms up with a batch of that size.
    kwargs = dict(model=spec["model"], dtype="float32", kv_cache_memory_bytes=1 << 30, max_model_len=512,
                  max_num_batched_tokens=512, max_num_seqs=8, seed=0)
    if spec["mode"] == "eager":
        kwargs["enforce_eager"] = True
    if spec.get("custom_ops") is not None:
        kwargs["compilation_config"] = {"custom_ops": list(spec["custom_ops"])}
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - started

    act_fns = llm.collective_rpc(describe_act_fns)[0]
    counts_after_startup = dict(counts)

    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    t0 = time.perf_counter()
    outputs = llm.generate(spec["prompts"], params, use_tqdm=False)
    generate_s = time.perf_counter() - t0

    from vllm.model_executor.custom_op import op_registry_oot

    result = {
        "spec": spec,
        "prompt_lengths": [len(o.prompt_token_ids) for o in outputs],
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "texts": [o.outputs[0].text for o in outputs],
        "act_fns": act_fns,
        "oot_registry": {k: f"{v.__module__}.{v.__qualname__}" for k, v in op_registry_oot.items()},
        "counts_after_startup": counts_after_startup,
        "counts": counts,
        "startup_s": round(startup_s, 1),
        "generate_s": round(generate_s, 1),
    }
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":  # vLLM may spawn processes that re-import this module
    main(sys.argv[1], sys.argv[2])
