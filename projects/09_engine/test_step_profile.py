"""The batch-1 CPU step profile (kernel_lab/engine/step_profile.py, cpu_step_profile.py) on the bundled model:
its parts add up to the measured step, it changes no token, and nothing stays wrapped after the block."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from kernel_lab.engine.step_profile import PARTS, StepProfile
from kernel_lab.ops import cpu_kernels

pytestmark = pytest.mark.usefixtures("one_cpu_thread", "bundled_model")

SCRIPT = Path(__file__).with_name("cpu_step_profile.py")


def _script():
    spec = importlib.util.spec_from_file_location("cpu_step_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_parts_sum_to_the_step():
    assert _script().main(["--smoke"]) == 0


def test_profile_accounts_for_the_step_and_changes_nothing(monkeypatch):
    monkeypatch.setenv("KERNEL_LAB_DECODE_STACK", "0")   # the layers op by op, so each part is seen
    script = _script()
    plain_engine = script.decoding_engine(None, input_len=16, steps=3)
    profiled_engine = script.decoding_engine(None, input_len=16, steps=3)
    runner = profiled_engine.runner
    before = {name: getattr(runner, name) for name in ("execute", "_prepare")}
    linear = cpu_kernels.load_library("gguf_linear").kl_gguf_linear
    for _ in range(3):
        want = [o.outputs[0].token_ids for o in plain_engine.step()]
        with StepProfile(profiled_engine) as prof:
            t0 = time.perf_counter()
            got = [o.outputs[0].token_ids for o in profiled_engine.step()]
            wall = (time.perf_counter() - t0) * 1e3
        assert got == want
        parts = prof.steps[-1]
        assert set(parts) - {"step"} <= set(PARTS)
        assert abs(parts["step"] - wall) <= 0.1 * wall, (parts, wall)
        assert parts["projections"] > 0 and parts["lm_head"] > 0 and parts["sampling"] > 0
        assert parts["projections (C)"] > 0 and parts["norms (C)"] > 0
    assert "step" not in vars(profiled_engine) and "forward" not in vars(runner.model.layers[0])
    assert {name: getattr(runner, name) for name in ("execute", "_prepare")} == before
    assert cpu_kernels.load_library("gguf_linear").kl_gguf_linear is linear
