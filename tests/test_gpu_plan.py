"""tools/gpu_plan.py, the one plan that tools/gpu_suite.sh and modal_app.py read: its default run fits the
suite's budget with every step at its full cap, covers projects 04-07 after one extension build, and leaves
the compile-only tests to CI; `gpu_suite.sh --plan` prints it on CPU without running anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_plan  # noqa: E402

FIRST = ("04_paged_decode", "05_fp8_kv", "06_topk_sampling", "07_moe")


def test_the_default_run_fits_the_budget_and_covers_04_to_07_in_full():
    steps = gpu_plan.suite_steps()
    fit = gpu_plan.planned(steps)
    assert sum(s.cap_s for s in steps[:fit]) <= gpu_plan.BUDGET_S - gpu_plan.SUMMARY_RESERVE_S
    assert gpu_plan.BUDGET_S <= gpu_plan.MAX_BUDGET_S
    kinds = [(s.project, s.kind) for s in steps[:fit]]
    assert kinds[:2] == [("setup", "environment"), ("setup", "build")]
    for project in FIRST:
        expected = {s.kind for s in gpu_plan.project_steps(f"projects/{project}")}
        assert expected and {k for p, k in kinds if p == project} == expected, project


def test_projects_04_to_07_come_before_01_to_03_and_each_project_fits_one_run():
    names = [Path(d).name for d in gpu_plan.project_dirs()]
    assert set(names) == {p.name for p in ROOT.glob("projects/[0-9][0-9]_*") if p.is_dir()}
    assert names[:4] == list(FIRST)
    assert max(names.index(p) for p in FIRST) < min(names.index(p) for p in ("01_rmsnorm", "02_swiglu", "03_gemm"))
    runs = gpu_plan.later_runs(gpu_plan.project_dirs())
    assert sorted(d for run in runs for d in run) == sorted(gpu_plan.project_dirs())
    for run in runs:  # every later run, setup and build included, fits a budget of its own
        steps = gpu_plan.suite_steps(run)
        assert gpu_plan.planned(steps) == len(steps), run


def test_the_extension_is_built_once_before_any_step_that_needs_it():
    steps = gpu_plan.suite_steps()
    builds = [i for i, s in enumerate(steps) if s.kind == "build"]
    assert len(builds) == 1
    assert all(i > builds[0] for i, s in enumerate(steps) if s.needs_extension or s.project in gpu_plan.NEEDS_EXTENSION)
    assert not any(s.kind == "build" for s in gpu_plan.suite_steps(["projects/01_rmsnorm", "projects/03_gemm"]))


def test_device_tests_leave_out_the_compile_only_ones():
    for step in gpu_plan.suite_steps():
        if step.kind == "pytest":
            assert step.argv[3:6] == ("-q", "-m", gpu_plan.DEVICE_MARKERS) and "compile_only" in step.shell()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", gpu_plan.DEVICE_MARKERS,
                          "projects/01_rmsnorm"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "test_rms_norm_matches_float64" in run.stdout and "test_gpu_large_shapes" in run.stdout
    assert "test_compiles_for_every_target_without_spills" not in run.stdout
    assert "test_sass_uses_128_bit_global_accesses" not in run.stdout


@pytest.mark.parametrize("arg, expected", [("python3", "$PY"), ("--junitxml={out}/logs/x.xml", '--junitxml="$OUT"/logs/x.xml'),
                                           ("not compile_only", "'not compile_only'")])
def test_commands_render_for_the_suite(arg, expected):
    step = gpu_plan.Step("p", "pytest", "l", (arg,), "log", 1)
    assert step.shell() == expected


def test_suite_plan_prints_every_step_with_its_cap_and_runs_nothing(tmp_path):
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    run = subprocess.run(["bash", "tools/gpu_suite.sh", "--plan"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    steps = gpu_plan.suite_steps()
    for i, step in enumerate(steps, 1):
        assert any(line.split()[:3] == [str(i), line.split()[1], f"{step.cap_s}s"] and step.kind in line
                   for line in run.stdout.splitlines() if line.strip().startswith(f"{i} ")), step
    assert f"planned: {gpu_plan.planned(steps)} of {len(steps)} steps" in run.stdout
    assert not (tmp_path / "out").exists()


def test_tsv_lines_carry_every_field_for_the_suite():
    run = subprocess.run([sys.executable, "tools/gpu_plan.py", "--tsv"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    lines = run.stdout.splitlines()
    steps = gpu_plan.suite_steps()
    assert len(lines) == len(steps)
    fit = gpu_plan.planned(steps)
    for i, (line, step) in enumerate(zip(lines, steps)):
        fields = line.split("\t")
        assert fields == [step.project, step.kind, str(step.cap_s), step.log, str(int(step.needs_extension)),
                          str(int(i < fit)), step.shell()]
