"""What must import on the bare validation box (python3 with torch, triton and pytest only): the engine
without numpy, and the GPU summary without torch (it reads the suite's files alone). Each runs in a child
process whose imports of the blocked packages fail as they would where the packages are not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKER = """
import sys
BLOCKED = {blocked!r}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
sys.meta_path.insert(0, Block())
"""


def run_without(blocked: tuple[str, ...], code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "0"}
    return subprocess.run([sys.executable, "-c", BLOCKER.format(blocked=set(blocked)) + code, *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=180)


def test_the_engine_imports_without_numpy():
    run = run_without(("numpy",), "import kernel_lab.engine, kernel_lab.models\nprint('numpy' in sys.modules)")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == "False"


def test_the_blocker_does_block():
    run = run_without(("numpy",), "import numpy")
    assert run.returncode != 0 and "blocked" in run.stderr


def test_the_gpu_summary_prints_its_table_without_torch(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "steps.tsv").write_text("project\tstep\trc\tseconds\tlimit_s\tnote\n"
                                    "setup\tbuild\t3\t2\t120\tcannot build the kernel_lab CUDA extension: ninja\n"
                                    "04_paged_decode\tgpu_checks\tskipped\t0\t0\tno ninja\n"
                                    "04_paged_decode\tpytest\t0\t30\t40\t\n"
                                    "01_rmsnorm\tpytest\tskipped\t0\t0\tdeadline\n")
    (logs / "04_paged_decode.junit.xml").write_text("<testsuite tests='5' failures='1' errors='0' skipped='1'/>")
    records = tmp_path / "results" / "04_paged_decode"
    records.mkdir(parents=True)
    (records / "r.json").write_text(json.dumps({"headline": {"percent_of_ceiling": 71.25, "speedup": 1.5,
                                                             "baseline": "torch"}}))
    code = ("import runpy\ntry:\n    runpy.run_path('tools/gpu_summary.py', run_name='__main__')\n"
            "finally:\n    print('torch' in sys.modules)")
    run = run_without(("torch", "triton", "numpy"), code, str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[-1] == "False"
    assert lines[0].startswith("setup: build rc 3") and "ninja" in lines[0]
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert "3/4 (1 skipped)" in rows["04_paged_decode"] and "71.2%" in rows["04_paged_decode"]
    assert "1.50x torch" in rows["04_paged_decode"] and "gpu_checks skipped (no ninja)" in rows["04_paged_decode"]
    assert "not run" in rows["01_rmsnorm"] and "pytest skipped (deadline)" in rows["01_rmsnorm"]
