#!/usr/bin/env python3
"""The GPU validation plan: every step a GPU run makes, in which phase, with its time cap. One plan, read by
tools/gpu_suite.sh (through `--vars` and `--tsv`) and by modal_app.py (imported). Standard library only: it
runs on the bare validation box before anything else, and on CPU for `--plan`.

    python3 tools/gpu_plan.py [--budget S] [--cores N] [--phases "checks bench tests"] [PROJECT_DIR ...]
                                          the plan, as `bash tools/gpu_suite.sh --plan` prints it
    python3 tools/gpu_plan.py --tsv ...   the steps for gpu_suite.sh, one a line (fields: TSV_FIELDS)
    python3 tools/gpu_plan.py --vars ...  the phase deadlines and test concurrency, as shell assignments

Phases, in this order; nothing of one overlaps the next:
  1. setup, serial: the environment record, then the CUDA extension build (once, when a project needs it).
  2. checks, serial: each project's gpu_checks.sh (extension load, compute-sanitizer memcheck and racecheck).
  3. bench, serial, one process alone on a quiet GPU: each project's --quick benchmark, records to
     $OUT/results, projects 04-07 first. Each runs under min(its cap, time left before the test reserve).
  4. tests, in parallel: every project's tests on the device (`-m "not compile_only"`: CI compiles every
     kernel for sm_80/89/90 already) as one pytest process per project, TEST_PROCESSES at a time
     (min(8, cores // 2)), longest first, OMP_NUM_THREADS=2 each. This phase takes all the time left: each
     pytest runs under min(its cap, time left) and is interrupted with SIGINT at the deadline, so it still
     writes its JUnit file and every finished test is already in $OUT/logs/<project>.tests.jsonl.

Why benchmarks before tests, and the tests in parallel: the first H200 run (2026-12-04) showed that a device
pytest step's cost is the CPU-side JIT compilation of a cold Triton cache, one parametrisation after
another, single-threaded: about 600 s of serial pytest for 01-07 alone, which can never share a 450 s
deadline with the benchmarks. Correctness checks do not care about timing, so on the box's 16 cores they run
as concurrent processes. Benchmarks do care, so they run before any test process exists, one at a time, and
bounded, so their records always come back; they also warm the Triton cache for the tests. Tests-first
under a fixed phase cap would give the same guarantees but make the benchmarks wait on the slowest test
process and on the kill of every straggler before a quiet GPU is certain; benchmarks-first needs neither.
Both phases are guaranteed time: the tests keep a reserve (TEST_RESERVE_S: their expected wall time, but at
least a quarter and at most three quarters of what setup and checks leave at full cap), which no serial step
may eat into; the benchmarks get the rest, and whatever they leave goes to the tests.

Caps are 1.4x (MARGIN) the seconds measured on the 2026-12-04 H200 run with a cold Triton cache
(results/gpu-runs/2026-12-04-nvidia-h200, logs/steps.tsv, suite.log and run3-tests/*.pytest.log there),
rounded up to 5 s. Every pytest step of that run was cut by its cap, so a project's pytest time is
extrapolated: the seconds the tests that passed before the cut took, scaled to the tests collected; and it
is multiplied by PARALLEL_SLOWDOWN (1.3, not yet measured: the parallel phase has not run on a GPU) for
running beside other test processes. Steps no GPU has run yet (08-11, and 01's benchmark beyond its 30 s
cut) carry a guess, marked as such in `--plan`. Projects whose benchmarks do not fit one run at full cap are
grouped into further runs (SUITE_PHASES=bench SUITE_PROJECTS=...), and likewise for tests.
"""

from __future__ import annotations

import argparse
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BUDGET_S = 450  # gpu_suite.sh's default deadline: the device gives 15 minutes in all, machine start included
MAX_BUDGET_S = 480  # the device tool's 10-minute call limit, less the start of the call and the transfers
KILL_GRACE_S = 5  # between the SIGINT at the deadline and the SIGKILL
SUMMARY_TIMEOUT_S = 8
PACK_TIMEOUT_S = 5  # tar of $OUT (logs, records) into gpu_suite_out.tgz
SUMMARY_RESERVE_S = KILL_GRACE_S + SUMMARY_TIMEOUT_S + PACK_TIMEOUT_S + 2  # kept back after the last step
DEVICE_MARKERS = "not compile_only"  # every test, GPU-marked ones included, except the compile-only ones
# modal_app.py: a rented GPU has no shared deadline and an L4 is several times slower than an H200, so a step
# there may take this many times its cap; a full (not --quick) benchmark sweep this many times more again.
MODAL_TIMEOUT_FACTOR = 10
FULL_SWEEP_FACTOR = 8

PHASES = ("setup", "checks", "bench", "tests")
SELECTABLE_PHASES = ("checks", "bench", "tests")  # SUITE_PHASES; setup always runs
PHASE_OF = {"environment": "setup", "build": "setup", "gpu_checks": "checks", "benchmark": "bench",
            "pytest": "tests", "summary": "end"}

VALIDATION_CORES = 16  # the H200 box's CPU cores: `--plan` describes it; the suite passes its own nproc
MAX_TEST_PROCESSES = 8
TEST_THREADS = 2  # OMP_NUM_THREADS (torch's intra-op threads) of each test process

PROJECT_ORDER = ("04_paged_decode", "05_fp8_kv", "06_topk_sampling", "07_moe", "01_rmsnorm", "02_swiglu",
                 "03_gemm", "08_vllm_plugin", "09_engine", "10_speculative", "11_multi_lora")
NEEDS_EXTENSION = {"04_paged_decode", "05_fp8_kv", "09_engine"}  # call the CUDA extension (kernel_lab/csrc)

MARGIN = 1.4  # cap = MARGIN x the measured (or guessed) seconds, rounded up to 5 s
PARALLEL_SLOWDOWN = 1.3  # a test process beside 7 others on 16 cores and one GPU: a guess, not yet measured
# Seconds measured on the 2026-12-04 H200 run (cold Triton cache), results/gpu-runs/2026-12-04-nvidia-h200.
SETUP_MEASURED_S = {"environment": 9, "build": 54}
MEASURED_S = {
    "04_paged_decode": {"gpu_checks": 20, "benchmark": 12},
    "05_fp8_kv": {"gpu_checks": 20, "benchmark": 8},
    "06_topk_sampling": {"benchmark": 26},  # run 2 (run 1 cut it at 20 s)
    "07_moe": {"benchmark": 38},  # run 2 (run 1 cut it at 20 s)
    "02_swiglu": {"benchmark": 33},  # its baselines are torch.compile'd (inductor)
    "03_gemm": {"benchmark": 23},  # run 2; cuBLAS ceilings, Triton configs compiled per shape
}
# pytest on that run: (tests passed before the cut, seconds until the cut, tests collected with DEVICE_MARKERS).
# Every one was cut, so its full time is extrapolated: seconds * collected / passed (skips counted as passed).
PYTEST_PARTIAL = {
    "01_rmsnorm": (105, 46, 130),  # run 3
    "02_swiglu": (128, 21, 186),
    "03_gemm": (49, 41, 186),
    "04_paged_decode": (143, 40, 361),
    "05_fp8_kv": (99, 25, 100),  # 56 passed, 43 skipped
    "06_topk_sampling": (80, 58, 169),  # run 3
    "07_moe": (64, 47, 123),  # run 3
}
# Not yet run on any GPU (or not to its end): guessed seconds, shown as guesses.
GUESSED_S = {
    "01_rmsnorm": {"benchmark": 32},  # more than 30: run 1 cut it at 30 s after it had written its records
    "08_vllm_plugin": {"pytest": 10},  # skips at once without vLLM (the box has none)
    "09_engine": {"pytest": 150, "benchmark": 65},  # 752 tests, most CPU-side (313 took 361 s on a 2-core CPU);
    # on the box the bundled model, gguf and numpy are absent, so many of them skip
    "10_speculative": {"pytest": 95, "benchmark": 11},  # pytest: 94 s on a 2-core CPU, interpreter included
    "11_multi_lora": {"pytest": 70, "benchmark": 43},  # pytest: 68 s on a 2-core CPU, interpreter included
}
DEFAULT_S = {"gpu_checks": 30, "pytest": 45, "benchmark": 40}  # a project or step not listed above (a guess)


def _round_up(seconds: float, to: int = 5) -> int:
    return int(math.ceil(seconds / to - 1e-9) * to)


def expected_s(project: str, kind: str) -> tuple[int, str]:
    """(seconds the step is expected to take on an H200, alone, cold cache; where the number comes from)."""
    if project == "setup":
        return SETUP_MEASURED_S[kind], "measured"
    if kind == "pytest" and project in PYTEST_PARTIAL:
        passed, seconds, collected = PYTEST_PARTIAL[project]
        return int(math.ceil(seconds * collected / passed)), "extrapolated"
    if kind in MEASURED_S.get(project, {}):
        return MEASURED_S[project][kind], "measured"
    return GUESSED_S.get(project, {}).get(kind, DEFAULT_S.get(kind, 60)), "guess"


def cap_for(project: str, kind: str) -> int:
    seconds = expected_s(project, kind)[0] * (PARALLEL_SLOWDOWN if kind == "pytest" else 1)
    return _round_up(MARGIN * seconds)


SETUP_CAPS = {kind: cap_for("setup", kind) for kind in SETUP_MEASURED_S}
_PROJECTS_NAMED = sorted(set(MEASURED_S) | set(PYTEST_PARTIAL) | set(GUESSED_S))
PROJECT_CAPS = {p: {k: cap_for(p, k) for k in ("gpu_checks", "pytest", "benchmark")} for p in _PROJECTS_NAMED}
DEFAULT_CAPS = {k: _round_up(MARGIN * s) for k, s in DEFAULT_S.items()}  # a project not listed above

TSV_FIELDS = ("phase", "project", "step", "cap_s", "log", "needs_extension", "planned", "command")


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
    expected_s: int = 0  # the time it is expected to take (alone); 0: cap_s / MARGIN

    @property
    def phase(self) -> str:
        return PHASE_OF[self.kind]

    @property
    def expect_s(self) -> int:
        return self.expected_s or int(self.cap_s / MARGIN)

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
                 SETUP_CAPS["environment"], ("tools/environment.py",),
                 expected_s=expected_s("setup", "environment")[0])]


def build_step() -> Step:
    return Step("setup", "build", "build CUDA extension (04/05)", ("python3", "-m", "kernel_lab.ops.cuda_extension"),
                "logs/build_extension.log", SETUP_CAPS["build"], ("kernel_lab/ops/cuda_extension.py",),
                expected_s=expected_s("setup", "build")[0])


def summary_step() -> Step:
    return Step("setup", "summary", "summary", ("python3", "tools/gpu_summary.py", "{out}"), "logs/summary.txt",
                SUMMARY_TIMEOUT_S, ("tools/gpu_summary.py",))


def pytest_step(project: str, target: str, cap_s: int, label: str | None = None) -> Step:
    """The tests at `target` (a project dir or one file) on the device, one JUnit file per project."""
    return Step(project, "pytest", label or f"{project} tests",
                ("python3", "-m", "pytest", "-q", "-m", DEVICE_MARKERS, "-p", "no:cacheprovider", target,
                 f"--junitxml={{out}}/logs/{project}.junit.xml"),
                f"logs/{project}.pytest.log", cap_s, (target,), expected_s=expected_s(project, "pytest")[0])


def benchmark_step(project: str, script: str, cap_s: int, quick: bool = True, label: str | None = None) -> Step:
    return Step(project, "benchmark", label or f"{project} benchmark",
                ("python3", script, *(("--quick",) if quick else ()), "--out", "{out}/results"),
                f"logs/{project}.bench.log", cap_s, (script,), needs_extension=project in NEEDS_EXTENSION,
                expected_s=expected_s(project, "benchmark")[0])


def _caps(name: str) -> dict[str, int]:
    return {**DEFAULT_CAPS, **PROJECT_CAPS.get(name, {})}


def project_steps(project_dir: str, repo: Path = REPO, kinds=("gpu_checks", "pytest", "benchmark"),
                  quick: bool = True) -> list[Step]:
    """The steps of one project that exist in its directory, of the given kinds, in that order of kinds."""
    name = Path(project_dir).name
    caps = _caps(name)
    here = repo / project_dir
    steps = []
    for kind in kinds:
        if kind == "gpu_checks" and (here / "gpu_checks.sh").exists():
            script = f"{project_dir}/gpu_checks.sh"
            steps.append(Step(name, "gpu_checks", f"{name} gpu_checks.sh", ("bash", script), f"logs/{name}.checks.log",
                              caps["gpu_checks"], (script,), needs_extension=name in NEEDS_EXTENSION,
                              expected_s=expected_s(name, "gpu_checks")[0]))
        if kind == "pytest" and any(here.glob("test_*.py")):
            steps.append(pytest_step(name, project_dir, caps["pytest"]))
        if kind == "benchmark" and (here / "benchmark.py").exists():
            steps.append(benchmark_step(name, f"{project_dir}/benchmark.py", caps["benchmark"], quick))
    return steps


def suite_steps(dirs: list[str] | None = None, repo: Path = REPO, phases=SELECTABLE_PHASES) -> list[Step]:
    """gpu_suite.sh's steps for these project dirs (default: every project) and phases, in the order they
    start: setup, every gpu_checks.sh, every benchmark (project order), then the tests, longest first."""
    dirs = order(dirs) if dirs is not None else project_dirs(repo)
    unknown = set(phases) - set(SELECTABLE_PHASES)
    if unknown:
        raise ValueError(f"phases are {', '.join(SELECTABLE_PHASES)}; got {', '.join(sorted(unknown))}")
    kinds = [k for k, phase in (("gpu_checks", "checks"), ("benchmark", "bench"), ("pytest", "tests"))
             if phase in phases]
    body = []
    for kind in kinds:
        of_kind = [s for d in dirs for s in project_steps(d, repo, (kind,))]
        if kind == "pytest":  # longest first (LPT), so the slowest project is not the last to start
            of_kind.sort(key=lambda s: -s.expect_s)  # stable: ties keep the project order
        body += of_kind
    steps = environment_steps()
    if any(s.project in NEEDS_EXTENSION for s in body):
        steps.append(build_step())
    return steps + body


def usable_s(budget_s: int) -> int:
    """Seconds for the steps: the deadline less what the interrupt, the summary and the archive need."""
    return min(budget_s, MAX_BUDGET_S) - SUMMARY_RESERVE_S


def concurrent_tests(cores: int = VALIDATION_CORES, override: int | None = None) -> int:
    """Concurrent pytest processes: half the cores (TEST_THREADS each), at most MAX_TEST_PROCESSES."""
    if override:
        return max(1, override)
    return max(1, min(MAX_TEST_PROCESSES, cores // TEST_THREADS))


def lpt(durations: list[float], slots: int) -> list[tuple[int, float]]:
    """(slot, start) of each duration when started in the given order on the first free of `slots`."""
    free = [0.0] * max(1, slots)
    placed = []
    for d in durations:
        slot = min(range(len(free)), key=lambda i: (free[i], i))
        placed.append((slot, free[slot]))
        free[slot] += d
    return placed


@dataclass
class Schedule:
    """When each step of a run is expected to start and whether it fits the budget at its full cap."""

    usable_s: int
    serial_caps_s: int  # setup and checks at full cap
    test_reserve_s: int  # kept for the test phase: no serial step may run into it
    serial_deadline_s: int  # elapsed seconds by which every serial step (setup, checks, bench) has ended
    processes: int
    threads: int
    test_wall_s: int  # the test phase's expected wall time (LPT of expected x slowdown)
    test_window_s: int  # the test phase's guaranteed length when every serial step takes its full cap
    starts: list[int]  # per step: serial steps' latest start (caps before it); tests: start within the phase
    slots: list[int | None]
    fits: list[bool]


def schedule(steps: list[Step], budget_s: int = BUDGET_S, cores: int = VALIDATION_CORES,
             processes: int | None = None) -> Schedule:
    usable = usable_s(budget_s)
    procs = concurrent_tests(cores, processes)
    threads = max(1, min(TEST_THREADS, cores // procs))
    slowdown = PARALLEL_SLOWDOWN if procs > 1 else 1.0
    tests = [s for s in steps if s.phase == "tests"]
    placed = lpt([s.expect_s * slowdown for s in tests], procs)
    test_wall = _round_up(max((start + s.expect_s * slowdown for (_, start), s in zip(placed, tests)), default=0), 1)
    serial_caps = sum(s.cap_s for s in steps if s.phase in ("setup", "checks"))
    bench_caps = sum(s.cap_s for s in steps if s.phase == "bench")
    room = max(0, usable - serial_caps)
    if not tests:
        reserve = 0
    elif bench_caps == 0:
        reserve = room
    else:
        reserve = min(max(test_wall, room // 4), room - room // 4)
    serial_deadline = usable - reserve
    window = usable - min(serial_caps + bench_caps, serial_deadline) if tests else 0
    starts, slots, fits = [], [], []
    used, ti = 0, 0
    for step in steps:
        if step.phase == "tests":
            slot, start = placed[ti]
            ti += 1
            starts.append(int(start))
            slots.append(slot)
            fits.append(start + step.expect_s * slowdown <= window)
        else:
            starts.append(used)
            slots.append(None)
            used += step.cap_s
            fits.append(used <= serial_deadline)
    return Schedule(usable, serial_caps, reserve, serial_deadline, procs, threads, test_wall, window, starts, slots,
                    fits)


def planned(steps: list[Step], budget_s: int = BUDGET_S, cores: int = VALIDATION_CORES) -> int:
    """How many of `steps` fit the budget (serial steps at full cap, tests at their expected parallel time)."""
    return sum(schedule(steps, budget_s, cores).fits)


def later_runs(dirs: list[str], budget_s: int = BUDGET_S, repo: Path = REPO, phases=SELECTABLE_PHASES,
               cores: int = VALIDATION_CORES) -> list[list[str]]:
    """The projects of `dirs` grouped, in order, into runs of these phases whose every step fits the budget."""
    runs: list[list[str]] = []
    for d in order(dirs):
        if runs and all(schedule(suite_steps(runs[-1] + [d], repo, phases), budget_s, cores).fits):
            runs[-1].append(d)
        else:
            runs.append([d])
    return runs


def _source(step: Step) -> str:
    if step.project == "setup":
        return "measured"
    return expected_s(step.project, step.kind)[1]


def describe(dirs: list[str] | None, budget_s: int = BUDGET_S, repo: Path = REPO, phases=SELECTABLE_PHASES,
             cores: int = VALIDATION_CORES, processes: int | None = None) -> str:
    steps = suite_steps(dirs, repo, phases)
    sch = schedule(steps, budget_s, cores, processes)
    tests = [s for s in steps if s.phase == "tests"]
    lines = [f"GPU suite plan: {len(steps)} steps; deadline {min(budget_s, MAX_BUDGET_S)} s: {sch.usable_s} s for "
             f"the steps, {SUMMARY_RESERVE_S} s kept for the last SIGINT/SIGKILL, the summary and the archive",
             f"caps: {MARGIN}x the seconds measured on the 2026-12-04 H200 run (cold Triton cache; pytest "
             f"extrapolated from its cut runs, x{PARALLEL_SLOWDOWN} for running in parallel), rounded up to 5 s; "
             "'guess' where no GPU has run the step to its end"]
    header = f"  {'#':>2}  {'starts by':>9}  {'cap':>5}  {'expect':>7}  {'project':<18} {'step':<11} command"
    shown = None
    for i, (step, start, slot, fit) in enumerate(zip(steps, sch.starts, sch.slots, sch.fits), 1):
        if step.phase != shown:
            shown = step.phase
            if step.phase == "setup":
                lines.append("phase 1, setup: serial")
            elif step.phase == "checks":
                lines.append("phase 2, checks: serial (compute-sanitizer)")
            elif step.phase == "bench":
                lines.append(f"phase 3, benchmarks: serial, alone on the GPU, each under min(cap, time left before "
                             f"{sch.serial_deadline_s} s); the tests keep the last {sch.test_reserve_s} s")
            else:
                lines.append(f"phase 4, tests: {len(tests)} pytest processes in parallel, {sch.processes} at a time "
                             f"({cores} cores, OMP_NUM_THREADS={sch.threads} each), longest first; expected wall "
                             f"{sch.test_wall_s} s, at least {sch.test_window_s} s left for it when every serial step "
                             "takes its full cap; all the time left, each pytest under min(cap, time left), "
                             "SIGINT at the deadline")
            lines.append(header.replace("starts by", "starts by" if step.phase != "tests" else "  +start "))
        mark = "" if fit else "  [may not fit: runs if time is left]"
        ext = "  (needs the extension)" if step.needs_extension else ""
        where = f"{start:8d}s" if step.phase != "tests" else f"+{start:7d}s"
        src = {"measured": " ", "extrapolated": "x", "guess": "?"}[_source(step)]
        slot_txt = f" [slot {slot + 1}]" if slot is not None else ""
        lines.append(f"  {i:2d}  {where}  {step.cap_s:4d}s  {step.expect_s:5d}s{src}  {step.project:<18} "
                     f"{step.kind:<11} {step.shell()}{ext}{slot_txt}{mark}")
    lines.append("  (expect: s measured, x extrapolated from a cut run, ? guessed; tests' expect is alone, "
                 f"x{PARALLEL_SLOWDOWN if sch.processes > 1 else 1.0} beside the others)")
    n_fit = sum(sch.fits)
    lines.append(f"planned: {n_fit} of {len(steps)} steps fit: serial steps at full cap by {sch.serial_deadline_s} s, "
                 f"the test phase expected {sch.test_wall_s} s of the {sch.test_window_s} s it is sure of")
    names = dirs if dirs is not None else project_dirs(repo)
    for phase_name, kind in (("bench", "benchmark"), ("tests", "pytest")):
        rest = {s.project for s, f in zip(steps, sch.fits) if not f and s.kind == kind}
        if not rest:
            continue
        left = [d for d in names if Path(d.rstrip("/")).name in rest]
        for run in later_runs(left, budget_s, repo, (phase_name,), cores):
            lines.append(f"a further run for what may not fit: SUITE_PHASES={phase_name} "
                         f"SUITE_PROJECTS=\"{' '.join(d.rstrip('/') + '/' for d in run)}\"")
    return "\n".join(lines)


def shell_vars(dirs: list[str] | None, budget_s: int, repo: Path = REPO, phases=SELECTABLE_PHASES,
               cores: int = VALIDATION_CORES, processes: int | None = None) -> str:
    sch = schedule(suite_steps(dirs, repo, phases), budget_s, cores, processes)
    values = {"BUDGET_S": min(budget_s, MAX_BUDGET_S), "USABLE_S": sch.usable_s,
              "SERIAL_DEADLINE_S": sch.serial_deadline_s, "TEST_RESERVE_S": sch.test_reserve_s,
              "TEST_PROCESSES": sch.processes, "TEST_THREADS": sch.threads, "TEST_WALL_S": sch.test_wall_s,
              "KILL_GRACE_S": KILL_GRACE_S, "SUMMARY_TIMEOUT_S": SUMMARY_TIMEOUT_S, "PACK_TIMEOUT_S": PACK_TIMEOUT_S}
    return "\n".join(f"{k}={v}" for k, v in values.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=BUDGET_S)
    parser.add_argument("--cores", type=int, default=VALIDATION_CORES, help="CPU cores of the machine")
    parser.add_argument("--processes", type=int, default=0, help="concurrent test processes (0: from --cores)")
    parser.add_argument("--phases", default=" ".join(SELECTABLE_PHASES),
                        help="which of checks, bench, tests (setup always runs)")
    parser.add_argument("--tsv", action="store_true", help="one step a line for gpu_suite.sh")
    parser.add_argument("--vars", action="store_true", help="the deadlines and concurrency as shell assignments")
    parser.add_argument("dirs", nargs="*", help="project dirs (default: every projects/NN_name)")
    args = parser.parse_args(argv)
    dirs = args.dirs or None
    phases = tuple(args.phases.replace(",", " ").split())
    try:
        steps = suite_steps(dirs, phases=phases)
    except ValueError as exc:
        parser.error(str(exc))
    if args.vars:
        print(shell_vars(dirs, args.budget, phases=phases, cores=args.cores, processes=args.processes or None))
    elif args.tsv:
        sch = schedule(steps, args.budget, args.cores, args.processes or None)
        for s, fit in zip(steps, sch.fits):  # fields without tabs; the command last, as a shell string for eval
            print("\t".join((s.phase, s.project, s.kind, str(s.cap_s), s.log, "1" if s.needs_extension else "0",
                             "1" if fit else "0", s.shell())))
    else:
        print(describe(dirs, args.budget, phases=phases, cores=args.cores, processes=args.processes or None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
