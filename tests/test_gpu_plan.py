"""tools/gpu_plan.py, the one plan that tools/gpu_suite.sh and modal_app.py read: setup, checks, benchmarks
serially, then the device tests as parallel pytest processes; the default run fits the suite's budget with
both the benchmarks and the tests given time, every project's steps are in it, its caps come from the
measured H200 run, and the compile-only tests are left to CI. gpu_suite.sh itself is run on CPU with a stand-in
interpreter: the benchmarks never overlap the tests, the tests run concurrently and are cut at the deadline
with partial results, and steps.tsv, the summary and the archive come out right."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_plan  # noqa: E402

FIRST = ("04_paged_decode", "05_fp8_kv", "06_topk_sampling", "07_moe")
PHASE_RANK = {p: i for i, p in enumerate(gpu_plan.PHASES)}


def test_the_default_run_fits_the_budget_with_time_for_benchmarks_and_tests():
    assert gpu_plan.BUDGET_S <= gpu_plan.MAX_BUDGET_S
    steps = gpu_plan.suite_steps()
    sch = gpu_plan.schedule(steps)
    assert sch.usable_s == gpu_plan.BUDGET_S - gpu_plan.SUMMARY_RESERVE_S
    assert sch.serial_deadline_s + sch.test_reserve_s == sch.usable_s
    # Setup and checks at full cap leave the benchmarks at least a quarter of the rest, the tests their reserve.
    room = sch.usable_s - sch.serial_caps_s
    assert sch.serial_deadline_s - sch.serial_caps_s >= room // 4 > 0
    assert sch.test_reserve_s >= room // 4 and sch.test_window_s >= sch.test_reserve_s
    fits = dict(zip(((s.project, s.kind) for s in steps), sch.fits))
    assert all(fit for (project, kind), fit in fits.items() if project == "setup" or kind == "gpu_checks")
    assert fits[("04_paged_decode", "benchmark")] and fits[("05_fp8_kv", "benchmark")]
    # On the 16-core box every project's tests are expected to end within the time the test phase is sure of.
    assert sch.processes == 8 and sch.threads == 2
    assert all(fit for (_, kind), fit in fits.items() if kind == "pytest")
    assert sch.test_wall_s <= sch.test_window_s


def test_every_projects_steps_are_in_the_plan_once():
    steps = gpu_plan.suite_steps()
    names = [Path(d).name for d in gpu_plan.project_dirs()]
    assert set(names) == {p.name for p in ROOT.glob("projects/[0-9][0-9]_*") if p.is_dir()}
    kinds = [(s.project, s.kind) for s in steps]
    assert len(kinds) == len(set(kinds))
    for d in gpu_plan.project_dirs():
        here, name = ROOT / d, Path(d).name
        expected = ({"gpu_checks"} if (here / "gpu_checks.sh").exists() else set()) \
            | ({"pytest"} if any(here.glob("test_*.py")) else set()) \
            | ({"benchmark"} if (here / "benchmark.py").exists() else set())
        assert {k for p, k in kinds if p == name} == expected, name
    assert kinds[0] == ("setup", "environment")


def test_phases_run_in_order_so_benchmarks_never_overlap_tests():
    for dirs in (None, ["projects/06_topk_sampling", "projects/01_rmsnorm"], ["projects/05_fp8_kv"]):
        steps = gpu_plan.suite_steps(dirs)
        ranks = [PHASE_RANK[s.phase] for s in steps]
        assert ranks == sorted(ranks), dirs
        sch = gpu_plan.schedule(steps)
        serial = [s for s in steps if s.phase != "tests"]
        # The serial steps' planned starts are caps in sequence; the tests start in their own phase.
        assert [st for s, st in zip(steps, sch.starts) if s.phase != "tests"] == \
            [sum(s.cap_s for s in serial[:i]) for i in range(len(serial))]
    bench = [s.project for s in gpu_plan.suite_steps() if s.kind == "benchmark"]
    assert bench[:4] == list(FIRST)
    tests = [s for s in gpu_plan.suite_steps() if s.kind == "pytest"]
    assert [s.expect_s for s in tests] == sorted((s.expect_s for s in tests), reverse=True)  # longest first


def test_caps_are_the_measured_seconds_with_a_margin():
    for kind, seconds in gpu_plan.SETUP_MEASURED_S.items():
        assert 1.3 * seconds <= gpu_plan.SETUP_CAPS[kind] <= 1.5 * seconds + 5
    for project, kinds in gpu_plan.MEASURED_S.items():
        for kind, seconds in kinds.items():
            assert 1.3 * seconds <= gpu_plan.cap_for(project, kind) <= 1.5 * seconds + 5, (project, kind)
    for project, (passed, seconds, collected) in gpu_plan.PYTEST_PARTIAL.items():
        full = seconds * collected / passed
        assert gpu_plan.expected_s(project, "pytest") == (math.ceil(full), "extrapolated")
        assert gpu_plan.cap_for(project, "pytest") >= 1.3 * gpu_plan.PARALLEL_SLOWDOWN * full
    assert gpu_plan.expected_s("03_gemm", "pytest")[0] > 150  # 49 of 186 tests in 41 s
    assert gpu_plan.expected_s("10_speculative", "pytest")[1] == "guess"


def test_the_extension_is_built_once_before_any_step_that_needs_it():
    steps = gpu_plan.suite_steps()
    builds = [i for i, s in enumerate(steps) if s.kind == "build"]
    assert len(builds) == 1
    assert all(i > builds[0] for i, s in enumerate(steps) if s.needs_extension or s.project in gpu_plan.NEEDS_EXTENSION)
    assert not any(s.kind == "build" for s in gpu_plan.suite_steps(["projects/01_rmsnorm", "projects/03_gemm"]))


def test_phases_can_be_chosen_and_later_runs_fit_a_budget_each():
    only_bench = gpu_plan.suite_steps(phases=("bench",))
    assert {s.phase for s in only_bench} == {"setup", "bench"}
    assert {s.phase for s in gpu_plan.suite_steps(phases=("tests",))} == {"setup", "tests"}
    with pytest.raises(ValueError):
        gpu_plan.suite_steps(phases=("bogus",))
    for phases in (("bench",), ("tests",), gpu_plan.SELECTABLE_PHASES):
        runs = gpu_plan.later_runs(gpu_plan.project_dirs(), phases=phases)
        assert sorted(d for run in runs for d in run) == sorted(gpu_plan.project_dirs())
        for run in runs:
            steps = gpu_plan.suite_steps(run, phases=phases)
            assert all(gpu_plan.schedule(steps).fits), (phases, run)


def test_concurrency_follows_the_cores():
    assert gpu_plan.concurrent_tests(16) == 8 and gpu_plan.concurrent_tests(64) == 8
    assert gpu_plan.concurrent_tests(2) == 1 and gpu_plan.concurrent_tests(1) == 1
    assert gpu_plan.concurrent_tests(2, override=3) == 3
    assert gpu_plan.lpt([5, 4, 3, 2], 2) == [(0, 0.0), (1, 0.0), (1, 4.0), (0, 5.0)]


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


def test_suite_plan_prints_every_phase_and_step_and_runs_nothing(tmp_path):
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    run = subprocess.run(["bash", "tools/gpu_suite.sh", "--plan"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    steps = gpu_plan.suite_steps()
    sch = gpu_plan.schedule(steps)
    rows = {line.split()[0]: line for line in run.stdout.splitlines() if line[:4].strip().isdigit()}
    for i, step in enumerate(steps, 1):
        assert f"{step.cap_s:4d}s" in rows[str(i)] and step.kind in rows[str(i)] and step.project in rows[str(i)], step
    for heading in ("phase 1, setup", "phase 2, checks", "phase 3, benchmarks", "phase 4, tests"):
        assert heading in run.stdout
    assert "8 at a time (16 cores, OMP_NUM_THREADS=2 each)" in run.stdout
    assert f"expected wall {sch.test_wall_s} s" in run.stdout and "2026-12-04 H200" in run.stdout
    assert f"planned: {sum(sch.fits)} of {len(steps)} steps fit" in run.stdout
    assert not (tmp_path / "out").exists()


def test_tsv_and_vars_carry_every_field_for_the_suite():
    run = subprocess.run([sys.executable, "tools/gpu_plan.py", "--tsv"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    lines = run.stdout.splitlines()
    steps = gpu_plan.suite_steps()
    fits = gpu_plan.schedule(steps).fits
    assert len(lines) == len(steps)
    for line, step, fit in zip(lines, steps, fits):
        fields = line.split("\t")
        assert len(fields) == len(gpu_plan.TSV_FIELDS)
        assert fields == [step.phase, step.project, step.kind, str(step.cap_s), step.log,
                          str(int(step.needs_extension)), str(int(fit)), step.shell()]
    run = subprocess.run([sys.executable, "tools/gpu_plan.py", "--vars", "--cores", "16"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    values = dict(line.split("=", 1) for line in run.stdout.splitlines())
    sch = gpu_plan.schedule(steps)
    assert values["SERIAL_DEADLINE_S"] == str(sch.serial_deadline_s) and values["TEST_PROCESSES"] == "8"
    suite = (ROOT / "tools/gpu_suite.sh").read_text()
    for name in values:  # every variable is read by the suite
        assert name in suite, name


# A stand-in for python3 in gpu_suite.sh: the plan, the summary and the environment record run for real;
# benchmarks and pytest only log when they start and end. 06's pytest runs until SIGINT (then exits as pytest
# does, its finished test logged), 07's ignores SIGINT until the SIGKILL, 10's ends at once.
FAKE_PYTHON = r"""#!/usr/bin/env bash
# No subprocess in stamp: timeout sends its SIGINT to the command and then to its whole process group, which
# would kill a `date` run from the trap.
stamp() { printf '%s %s %s\n' "$1" "$2" "$EPOCHREALTIME" >> "$EVENTS"; }
project=$(echo "$*" | grep -o 'projects/[0-9][0-9]_[a-z_]*' | head -n 1 | cut -d/ -f2)
if [ "$1 $2" = "-m pytest" ]; then
  stamp start-test "$project"
  echo "{\"test\": \"$project::t\", \"when\": \"call\", \"outcome\": \"passed\", \"seconds\": 0.1}" >> "$KERNEL_LAB_TEST_LOG"
  case $project in
    06_topk_sampling) trap 'kill $!; stamp end-test $project; echo "1 passed in 9s"; exit 2' INT; sleep 100 & wait ;;
    07_moe) trap '' INT; sleep 100 ;;
    *) sleep 1; stamp end-test "$project"; echo "1 passed in 1s" ;;
  esac
  exit 0
fi
case $1 in
  projects/*/benchmark.py) stamp start-bench "$project"; sleep 1; stamp end-bench "$project"; exit 0 ;;
esac
exec "$REAL_PYTHON" "$@"
"""


@pytest.mark.slow  # about 25 s: the suite runs to its (40 s) deadline
def test_the_suite_runs_benchmarks_alone_then_concurrent_tests_cut_at_the_deadline(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out, events = tmp_path / "out", tmp_path / "events.txt"
    (out / "cache").mkdir(parents=True)
    (out / "cache" / "big.bin").write_bytes(b"x" * 1000)
    budget = 40
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHON": str(fake), "REAL_PYTHON": sys.executable,
           "EVENTS": str(events), "OUT": str(out), "BUDGET_S": str(budget), "SUITE_TEST_PROCESSES": "2",
           "SUITE_PROJECTS": "projects/06_topk_sampling/ projects/07_moe/ projects/10_speculative/"}
    started = time.monotonic()
    run = subprocess.run(["bash", "tools/gpu_suite.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=budget + 30)
    elapsed = time.monotonic() - started
    assert run.returncode == 0, run.stdout + run.stderr
    assert elapsed < budget, elapsed

    times: dict[tuple[str, str], float] = {}
    for line in events.read_text().splitlines():
        what, project, t = line.split()
        times[(what, project)] = float(t)
    bench_end = max(t for (what, _), t in times.items() if what == "end-bench")
    test_start = min(t for (what, _), t in times.items() if what == "start-test")
    assert {p for (what, p) in times if what == "end-bench"} == {"06_topk_sampling", "07_moe", "10_speculative"}
    assert bench_end <= test_start  # no test process exists while a benchmark runs
    # Two at a time, longest first (06, 10), and 07 in the slot 10 leaves; 06 and 07 end at the deadline.
    assert abs(times[("start-test", "06_topk_sampling")] - times[("start-test", "10_speculative")]) < 2
    assert times[("start-test", "07_moe")] >= times[("end-test", "10_speculative")]
    assert times[("end-test", "06_topk_sampling")] - test_start > 5  # ran until the SIGINT, not at once

    rows = list(csv.DictReader((out / "logs" / "steps.tsv").open(), delimiter="\t"))
    assert list(rows[0]) == ["project", "step", "rc", "seconds", "limit_s", "note"]
    by = {(r["project"], r["step"]): r for r in rows}
    assert by[("setup", "environment")]["rc"] == "0"
    assert all(by[(p, "benchmark")]["rc"] == "0" for p in ("06_topk_sampling", "07_moe", "10_speculative"))
    assert by[("10_speculative", "pytest")]["rc"] == "0"
    assert by[("06_topk_sampling", "pytest")]["rc"] == "124" and by[("07_moe", "pytest")]["rc"] == "124"
    summary = (out / "summary.txt").read_text()
    assert "partial 1/1, timed out" in summary and "10_speculative" in summary
    assert (out / "logs" / "suite.log").read_text().count("start ") >= 3
    with tarfile.open(out / "gpu_suite_out.tgz") as tgz:
        names = set(tgz.getnames())
    assert {"./logs/steps.tsv", "./summary.txt", "./logs/07_moe.tests.jsonl", "./logs/suite.log"} <= names
    assert not any(n.startswith("./cache") or n.endswith(".tgz") for n in names)
