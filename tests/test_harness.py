"""The harness must be right before any number it produces can be trusted."""

import json
import math
import sys

import pytest
import torch

from kernel_lab.harness import results
from kernel_lab.harness.bench import Timing, benchmark, inputs_for_rotation, summarize
from kernel_lab.harness.compile import parse_ptxas_log
from kernel_lab.harness.testing import assert_close, assert_rounded_equal, case_seed, empty_poisoned, poison, randn
from kernel_lab.ops.common import check_tensor, use_triton


def test_quantiles_are_exact_on_a_known_sample():
    t = summarize([5.0, 1.0, 4.0, 2.0, 3.0], {"timer": "test"})
    assert (t.median_ms, t.min_ms, t.samples) == (3.0, 1.0, 5)
    assert math.isclose(t.p20_ms, 1.8) and math.isclose(t.p80_ms, 4.2)


def test_cpu_benchmark_rotates_inputs_and_reports_cpu_method():
    calls = []
    t = benchmark([lambda: calls.append(0), lambda: calls.append(1)], device="cpu", warmup=2, rep=6)
    assert calls.count(0) and calls.count(1), "every input set must be used"
    assert t.method["device"] == "cpu" and "CPU" in t.method["timer"]
    assert 0 <= t.min_ms <= t.p20_ms <= t.median_ms <= t.p80_ms


def test_rotation_count_covers_twice_l2():
    assert inputs_for_rotation(1 << 30, l2_bytes=50 << 20) == 1
    assert inputs_for_rotation(10 << 20, l2_bytes=50 << 20) == 10
    assert inputs_for_rotation(1, l2_bytes=50 << 20) == 16


def _timing(ms=1.0):
    return Timing(ms, ms * 0.9, ms * 1.1, ms * 0.8, 10, {"timer": "test"})


@pytest.fixture
def fake_ceilings(monkeypatch):
    monkeypatch.setattr(results, "ceilings", lambda device: {"copy": {"GBps": 100.0}, "matmul": {"TFLOPs": 10.0}})


def test_record_derives_bandwidth_percent_and_speedup(tmp_path, fake_ceilings):
    rec = results.ResultRecord("01_rmsnorm", "unit test", "cpu")
    case = rec.add_case("c", shape={"n": 1}, dtype="bf16", timing=_timing(1.0), nbytes=50_000_000,
                        baselines={"torch eager": _timing(3.0)})
    assert math.isclose(case["metric"]["value"], 50.0)  # 50 MB in 1 ms
    assert math.isclose(case["percent_of_ceiling"], 50.0)
    assert math.isclose(case["speedup"]["torch eager"], 3.0)
    path = rec.write(tmp_path)
    written = json.loads(path.read_text())
    results.validate(written)
    assert written["env"]["torch"] == torch.__version__
    assert "CPU run" in rec.table()


def test_records_are_written_unvalidated_without_jsonschema(tmp_path, fake_ceilings, monkeypatch):
    """The bare GPU box has no jsonschema: a benchmark there must still write its record."""
    monkeypatch.setitem(sys.modules, "jsonschema", None)  # makes `import jsonschema` raise ImportError
    rec = results.ResultRecord("01_rmsnorm", "unit test", "cpu")
    rec.add_case("c", shape={}, dtype="fp16", timing=_timing(), flops=1e9)
    assert results.validate(rec.record) is False
    assert rec.write(tmp_path).exists()


def test_invalid_records_are_refused(tmp_path, fake_ceilings):
    pytest.importorskip("jsonschema")
    rec = results.ResultRecord("01_rmsnorm", "unit test", "cpu")
    with pytest.raises(results.InvalidRecord):
        rec.write(tmp_path)  # no cases
    rec.add_case("c", shape={}, dtype="fp16", timing=_timing(), flops=1e9)
    bad = json.loads(json.dumps(rec.record))
    del bad["cases"][0]["timing"]["p20_ms"]
    with pytest.raises(results.InvalidRecord):
        results.validate(bad)
    (tmp_path / "01_rmsnorm").mkdir()
    (tmp_path / "01_rmsnorm" / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(SystemExit, match="invalid result record"):
        results.render(tmp_path)


def test_render_says_plainly_when_a_project_has_no_gpu_record(tmp_path):
    text = results.render(tmp_path)
    for project in results.PROJECTS:
        assert f"## {project}" in text
    assert text.count("Not yet measured on a GPU") == len(results.PROJECTS)


def test_results_md_is_generated_from_the_committed_records():
    from kernel_lab.harness.env import REPO_ROOT

    assert (REPO_ROOT / "RESULTS.md").read_text() == results.render(REPO_ROOT / "results"), "run `make results`"


def test_poison_makes_unwritten_elements_fail():
    out = empty_poisoned((4,), torch.float16, "cpu")
    assert torch.isnan(out).all()
    with pytest.raises(AssertionError, match="non-finite=4"):
        assert_close(out, torch.ones(4, dtype=torch.float64))
    ints = poison(torch.zeros(3, dtype=torch.int32))
    assert (ints == torch.iinfo(torch.int32).max).all()


def test_assert_close_catches_a_small_systematic_error():
    ref = torch.randn(1000, dtype=torch.float64)
    assert_close(ref.float(), ref)
    with pytest.raises(AssertionError):
        assert_close((ref * 1.001).float(), ref)


def test_assert_rounded_equal_is_exact_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    exact = torch.tensor([1.0 + 2**-9], dtype=torch.float64)
    with pytest.raises(AssertionError):
        assert_rounded_equal(torch.tensor([1.0 + 2**-7], dtype=torch.bfloat16), exact, torch.bfloat16)
    assert_rounded_equal(exact.to(torch.bfloat16), exact, torch.bfloat16)


def test_random_inputs_are_seeded_and_never_zero():
    a = randn((64,), torch.float32, "cpu", case_seed("x", 1))
    assert torch.equal(a, randn((64,), torch.float32, "cpu", case_seed("x", 1)))
    assert not torch.equal(a, randn((64,), torch.float32, "cpu", case_seed("x", 2)))
    assert (a != 0).all()


def test_ptxas_log_parsing():
    log = """ptxas info    : Used 40 registers, used 1 barriers, 8 bytes cumulative stack size
ptxas info    : Function properties for k
    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 64 registers"""
    r = parse_ptxas_log(log)
    assert r == {"registers": 64, "spill_stores": 8, "spill_loads": 12, "stack_frame": 16, "functions": 2}


def test_dispatch_rule_follows_the_interpreter_switch(monkeypatch):
    x = torch.ones(2)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(x)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not use_triton(x)


def test_input_checks_name_the_argument():
    with pytest.raises(TypeError, match="logits must be a torch.Tensor"):
        check_tensor("logits", [1.0])
    with pytest.raises(TypeError, match=r"q must have dtype in \(float16, bfloat16\), got float32"):
        check_tensor("q", torch.ones(1), dtypes=(torch.float16, torch.bfloat16))
    with pytest.raises(ValueError, match="x must be 2-D"):
        check_tensor("x", torch.ones(1), ndim=2)


def test_read_bandwidth_is_measured_with_the_asked_threads_and_restores_the_count():
    import torch

    from kernel_lab.harness import roofline

    seen = []
    real_benchmark = roofline.benchmark

    def spy(fn, **kwargs):
        seen.append(torch.get_num_threads())
        return real_benchmark(fn, **kwargs)

    before = torch.get_num_threads()
    roofline.benchmark, saved = spy, roofline.benchmark
    try:
        out = roofline.measure_read_bandwidth(1, nbytes=8 << 20)
    finally:
        roofline.benchmark = saved
    assert seen == [1] and torch.get_num_threads() == before
    assert out["threads"] == 1 and out["GBps"] > 0 and "8 MiB" in out["method"]


def test_cpu_ceilings_are_cached_per_cpu_model():
    from kernel_lab.harness import env, roofline

    key = roofline._cache_key(__import__("torch").device("cpu"))
    assert (env._cpu_description()[0] or "None") in key
