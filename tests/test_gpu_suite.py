"""tools/gpu_suite.sh on CPU, with fake projects: the deadline holds even when a test ignores SIGINT and
hangs, a timed-out project reports the tests it finished while the projects tested beside it finish, and the
summary table is printed last."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAST = "def test_one():\n    assert 1 + 1 == 2\n\n\ndef test_two():\n    assert 'a' < 'b'\n"
# Passes one test, then hangs deaf to SIGINT (as a test stuck in a CUDA call would): only SIGKILL ends it.
HANGS = ("import signal\nimport time\n\n\ndef test_first():\n    assert True\n\n\n"
         "def test_hangs():\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    time.sleep(600)\n")


def test_suite_keeps_its_deadline_and_reports_partial_results(tmp_path):
    projects = tmp_path / "projects"
    for name, source in (("01_fast", FAST), ("02_hangs", HANGS), ("03_late", FAST)):
        (projects / name).mkdir(parents=True)
        (projects / name / "test_case.py").write_text(source)
        shutil.copy(ROOT / "conftest.py", projects / name / "conftest.py")  # the per-test log hook
    out = tmp_path / "out"
    budget = 30
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OUT": str(out), "BUDGET_S": str(budget),
           "PYTHON": sys.executable, "SUITE_PROJECTS": f"{projects}/*/", "CUDA_VISIBLE_DEVICES": "",
           "SUITE_TEST_PROCESSES": "3"}  # the three test processes side by side, as on the 16-core box
    start = time.monotonic()
    run = subprocess.run(["bash", "tools/gpu_suite.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=budget + 30)
    elapsed = time.monotonic() - start
    assert elapsed <= budget + 2, f"the suite ran {elapsed:.0f} s past its {budget} s deadline"
    table = run.stdout[run.stdout.rindex("\nproject  ") + 1:].splitlines()  # the summary table, printed last
    rows = {line.split()[0]: line for line in table[1:]}
    assert "2/2" in rows["01_fast"], rows
    assert "partial 1/1, timed out" in rows["02_hangs"] and "pytest timed out" in rows["02_hangs"], rows
    assert "2/2" in rows["03_late"], rows  # tested beside the hanging project, not after it
    assert table[-1] == run.stdout.rstrip().splitlines()[-1], "the summary table must be printed last"
    assert not (out / "logs" / "02_hangs.junit.xml").exists()  # killed: the per-test log was the source


def test_steps_that_need_an_unavailable_extension_are_skipped_with_the_reason(tmp_path):
    """A project that needs the CUDA extension on a machine that cannot build it (here: no GPU): the build
    runs once, first, says why in one line, and the project's gpu_checks.sh and benchmark are skipped with
    that line while its tests still run; the plan is printed before anything runs."""
    project = tmp_path / "projects" / "04_paged_decode"
    project.mkdir(parents=True)
    (project / "test_case.py").write_text(FAST + "\n\ndef test_sees_the_reason():\n    import os\n"
                                          "    assert os.environ['KERNEL_LAB_EXTENSION_UNAVAILABLE']\n")
    shutil.copy(ROOT / "conftest.py", project / "conftest.py")
    ran = tmp_path / "ran"
    (project / "gpu_checks.sh").write_text(f"touch {ran}/checks\n")
    (project / "benchmark.py").write_text(f"open('{ran}/benchmark', 'w').close()\n")
    ran.mkdir()
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OUT": str(out), "BUDGET_S": "120",
           "PYTHON": sys.executable, "SUITE_PROJECTS": f"{project}/", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(["bash", "tools/gpu_suite.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=180)
    assert run.stdout.index("GPU suite plan:") < run.stdout.index("== setup")
    assert list(ran.iterdir()) == []
    rows = [line.split("\t") for line in (out / "logs" / "steps.tsv").read_text().splitlines()[1:]]
    by_step = {(r[0], r[1]): r for r in rows}
    assert [r[1] for r in rows] == ["environment", "build", "gpu_checks", "benchmark", "pytest"]
    build = by_step[("setup", "build")]
    assert build[2] == "3" and build[5].startswith("the kernel_lab CUDA extension needs a CUDA device"), build
    for step in ("gpu_checks", "benchmark"):
        assert by_step[("04_paged_decode", step)][2:] == ["skipped", "0", "0", build[5]]
    assert by_step[("04_paged_decode", "pytest")][2] == "0"
    table = run.stdout[run.stdout.rindex("\nproject  ") + 1:].splitlines()
    assert "3/3" in table[1] and "gpu_checks skipped (the kernel_lab CUDA extension needs" in table[1], table
