#!/usr/bin/env python3
"""The GPU validation plan: every step a GPU run makes, in order, with its time cap. One plan, read by
tools/gpu_suite.sh (through `--tsv`) and by modal_app.py (imported). Standard library only: it runs on the bare
validation box before anything else, and on CPU for `--plan`.

    python3 tools/gpu_plan.py [--budget S] [PROJECT_DIR ...]        the plan, as `bash tools/gpu_suite.sh --plan`
    python3 tools/gpu_plan.py --tsv [--budget S] [PROJECT_DIR ...]  the steps for gpu_suite.sh, one a line

Order: the environment record, the CUDA extension build (once, first, when a project needs it), then each
project's gpu_checks.sh, tests and --quick benchmark; projects 04-07 (never measured on any GPU) before 01-03,
the engine last. On the device the tests run without the compile-only ones (`-m "not compile_only"`): CI
compiles every kernel for sm_80/89/90 already. Caps are seconds on an H200 (a guess until the first run's
logs/steps.tsv says otherwise). The budget is packed in order: the steps whose caps fit it are the planned
run; the suite goes on with the rest while time is left, each under min(cap, time left), and `--plan`
groups what may not fit into further runs of the same budget (SUITE_PROJECTS=...).
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BUDGET_S = 450  # gpu_suite.sh's default deadline: the device gives 15 minutes in all, machine start included
MAX_BUDGET_S = 480  # the device tool's 10-minute call limit, less the start of the call and the transfers
SUMMARY_RESERVE_S = 10  # kept back for the summary table and the 5 s between SIGINT and SIGKILL of the last step
SUMMARY_TIMEOUT_S = 8
DEVICE_MARKERS = "not compile_only"  # every test, GPU-marked ones included, except the compile-only ones
# modal_app.py: a rented GPU has no shared deadline and an L4 is several times slower than an H200, so a step
# there may take this many times its cap; a full (not --quick) benchmark sweep this many times more again.
MODAL_TIMEOUT_FACTOR = 10
FULL_SWEEP_FACTOR = 8

PROJECT_ORDER = ("04_paged_decode", "05_fp8_kv", "06_topk_sampling", "07_moe", "01_rmsnorm", "02_swiglu",
                 "03_gemm", "08_vllm_plugin", "09_engine", "10_speculative", "11_multi_lora")
NEEDS_EXTENSION = {"04_paged_decode", "05_fp8_kv", "09_engine"}  # call the CUDA extension (kernel_lab/csrc)
SETUP_CAPS = {"environment": 15, "build": 130}
# Per project: gpu_checks.sh (extension load, two compute-sanitizer runs), pytest, benchmark --quick.
PROJECT_CAPS = {
    "04_paged_decode": {"gpu_checks": 45, "pytest": 40, "benchmark": 25},
    "05_fp8_kv": {"gpu_checks": 45, "pytest": 25, "benchmark": 20},
    "06_topk_sampling": {"pytest": 30, "benchmark": 20},
    "07_moe": {"pytest": 25, "benchmark": 20},
    "01_rmsnorm": {"pytest": 25, "benchmark": 30},
    "02_swiglu": {"pytest": 25, "benchmark": 40},  # its baselines are torch.compile'd (inductor)
    "03_gemm": {"pytest": 90, "benchmark": 60},  # cuBLAS ceilings, Triton configs compiled per shape
    "08_vllm_plugin": {"pytest": 30},  # skips at once without vLLM (the box has none)
    "09_engine": {"pytest": 60, "benchmark": 90},
    "10_speculative": {"pytest": 20, "benchmark": 15},  # a small kernel: GPU tests compare two vocabularies
}
DEFAULT_CAPS = {"gpu_checks": 60, "pytest": 60, "benchmark": 60}  # a project not listed above


@dataclass(frozen=True)
class Step:
    """One command, run from the repo root. In argv `python3` is the interpreter to use and `{out}` the out
    dir; its stdout and stderr go to `log`."""

    project: str  # "setup" for the environment and the build
    kind: str  # environment, build, gpu_checks, pytest, benchmark, summary
    label: str
    argv: tuple[str, ...]
    log: str  # relative to the out dir
    cap_s: int
    needs: tuple[str, ...] = ()  # repo files the command runs
    needs_extension: bool = False  # skipped when the extension is neither cached nor buildable

    def shell(self) -> str:
        """The command for gpu_suite.sh: `$PY` for python3, `"$OUT"` for {out}, quoted for eval."""
        words = []
        for arg in self.argv:
            if arg == "python3":
                words.append("$PY")
            else:
                words.append('"$OUT"'.join(shlex.quote(part) if part else "" for part in arg.split("{out}")))
        return " ".join(words)


def project_dirs(repo: Path = REPO) -> list[str]:
    """Repo-relative project directories (projects/NN_name) in the plan's order."""
    return order([p.relative_to(repo).as_posix() for p in repo.glob("projects/[0-9][0-9]_*") if p.is_dir()])


def order(dirs: list[str]) -> list[str]:
    """Project dirs in PROJECT_ORDER; projects it does not name come after, by name."""
    def rank(d: str):
        name = Path(d).name
        return (PROJECT_ORDER.index(name), name) if name in PROJECT_ORDER else (len(PROJECT_ORDER), name)

    return sorted((d.rstrip("/") for d in dirs), key=rank)


def environment_steps() -> list[Step]:
    """The environment record (environment.json, which every result carries) and what is missing, one probe."""
    return [Step("setup", "environment", "environment record",
                 ("python3", "tools/environment.py", "--write", "{out}/environment.json"), "logs/environment.txt",
                 SETUP_CAPS["environment"], ("tools/environment.py",))]


def build_step() -> Step:
    return Step("setup", "build", "build CUDA extension (04/05)", ("python3", "-m", "kernel_lab.ops.cuda_extension"),
                "logs/build_extension.log", SETUP_CAPS["build"], ("kernel_lab/ops/cuda_extension.py",))


def summary_step() -> Step:
    return Step("setup", "summary", "summary", ("python3", "tools/gpu_summary.py", "{out}"), "logs/summary.txt",
                SUMMARY_TIMEOUT_S, ("tools/gpu_summary.py",))


def pytest_step(project: str, target: str, cap_s: int, label: str | None = None) -> Step:
    """The tests at `target` (a project dir or one file) on the device, one JUnit file per project."""
    return Step(project, "pytest", label or f"{project} tests",
                ("python3", "-m", "pytest", "-q", "-m", DEVICE_MARKERS, "-p", "no:cacheprovider", target,
                 f"--junitxml={{out}}/logs/{project}.junit.xml"),
                f"logs/{project}.pytest.log", cap_s, (target,))


def benchmark_step(project: str, script: str, cap_s: int, quick: bool = True, label: str | None = None) -> Step:
    return Step(project, "benchmark", label or f"{project} benchmark",
                ("python3", script, *(("--quick",) if quick else ()), "--out", "{out}/results"),
                f"logs/{project}.bench.log", cap_s, (script,), needs_extension=project in NEEDS_EXTENSION)


def project_steps(project_dir: str, repo: Path = REPO, kinds=("gpu_checks", "pytest", "benchmark"),
                  quick: bool = True) -> list[Step]:
    """The steps of one project that exist in its directory, of the given kinds, in order."""
    name = Path(project_dir).name
    caps = {**DEFAULT_CAPS, **PROJECT_CAPS.get(name, {})}
    here = repo / project_dir
    steps = []
    if "gpu_checks" in kinds and (here / "gpu_checks.sh").exists():
        script = f"{project_dir}/gpu_checks.sh"
        steps.append(Step(name, "gpu_checks", f"{name} gpu_checks.sh", ("bash", script), f"logs/{name}.checks.log",
                          caps["gpu_checks"], (script,), needs_extension=name in NEEDS_EXTENSION))
    if "pytest" in kinds and any(here.glob("test_*.py")):
        steps.append(pytest_step(name, project_dir, caps["pytest"]))
    if "benchmark" in kinds and (here / "benchmark.py").exists():
        steps.append(benchmark_step(name, f"{project_dir}/benchmark.py", caps["benchmark"], quick))
    return steps


def suite_steps(dirs: list[str] | None = None, repo: Path = REPO) -> list[Step]:
    """gpu_suite.sh's steps for these project dirs (default: every project), in order."""
    dirs = order(dirs) if dirs is not None else project_dirs(repo)
    steps = environment_steps()
    if any(Path(d).name in NEEDS_EXTENSION for d in dirs):
        steps.append(build_step())
    for d in dirs:
        steps += project_steps(d, repo)
    return steps


def usable_s(budget_s: int) -> int:
    return min(budget_s, MAX_BUDGET_S) - SUMMARY_RESERVE_S


def planned(steps: list[Step], budget_s: int = BUDGET_S) -> int:
    """How many of `steps`, from the first, fit the budget with every one at its full cap."""
    used = 0
    for i, step in enumerate(steps):
        used += step.cap_s
        if used > usable_s(budget_s):
            return i
    return len(steps)


def later_runs(dirs: list[str], budget_s: int = BUDGET_S, repo: Path = REPO) -> list[list[str]]:
    """The projects of `dirs` grouped, in order, into runs whose steps (setup included) fit the budget each."""
    runs: list[list[str]] = []
    for d in order(dirs):
        if runs and planned(suite_steps(runs[-1] + [d], repo), budget_s) == len(suite_steps(runs[-1] + [d], repo)):
            runs[-1].append(d)
        else:
            runs.append([d])
    return runs


def describe(dirs: list[str] | None, budget_s: int = BUDGET_S, repo: Path = REPO) -> str:
    steps = suite_steps(dirs, repo)
    fit = planned(steps, budget_s)
    lines = [f"GPU suite plan: {len(steps)} steps; deadline {min(budget_s, MAX_BUDGET_S)} s, of which "
             f"{usable_s(budget_s)} s for steps (each step under min(cap, time left))",
             f"  {'#':>2}  {'starts by':>9}  {'cap':>5}  {'project':<18} {'step':<16} command"]
    start = 0
    for i, step in enumerate(steps, 1):
        if i == fit + 1:
            lines.append(f"  -- after the planned {start} s: run while time is left, else in a later run")
        ext = "  (needs the extension)" if step.needs_extension else ""
        lines.append(f"  {i:2d}  {start:8d}s  {step.cap_s:4d}s  {step.project:<18} {step.kind:<16} {step.shell()}{ext}")
        start += step.cap_s
    lines.append(f"planned: {fit} of {len(steps)} steps, {sum(s.cap_s for s in steps[:fit])} s of caps within "
                 f"{usable_s(budget_s)} s")
    rest = sorted({s.project for s in steps[fit:]} - {"setup"}, key=lambda n: order([n]))
    if rest:
        names = [d for d in (dirs if dirs is not None else project_dirs(repo)) if Path(d.rstrip("/")).name in rest]
        for n, run in enumerate(later_runs(names, budget_s, repo), 2):
            lines.append(f"run {n} if this one runs out: SUITE_PROJECTS=\"{' '.join(d + '/' for d in run)}\"")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=BUDGET_S)
    parser.add_argument("--tsv", action="store_true", help="one step a line for gpu_suite.sh")
    parser.add_argument("dirs", nargs="*", help="project dirs (default: every projects/NN_name)")
    args = parser.parse_args(argv)
    dirs = args.dirs or None
    if not args.tsv:
        print(describe(dirs, args.budget))
        return 0
    steps = suite_steps(dirs)
    fit = planned(steps, args.budget)
    for i, s in enumerate(steps):  # fields without tabs; the command last, as a shell string for eval
        print("\t".join((s.project, s.kind, str(s.cap_s), s.log, "1" if s.needs_extension else "0",
                         "1" if i < fit else "0", s.shell())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
