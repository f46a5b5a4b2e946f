"""Ahead-of-time compilation without a GPU: Triton to PTX/cubin/SASS, nvcc for CUDA C++, and the
ptxas register/spill report.

Triton kernels are compiled in a child process with TRITON_INTERPRET unset, because a kernel decorated
under the interpreter (as every kernel is in the CPU test process) cannot be handed to the compiler.
The harness does not know any kernel: an ops module exposes `compile_specs()`, a list of CompileSpec, and
`compile_module("kernel_lab.ops.rmsnorm", targets)` compiles each one for each target. A module whose
kernels are not Triton (the CuTe DSL GEMM) exposes `compile_artifacts(arch, out_dir, only)` instead and goes
through the same child process (`start_compile_child` / `finish_compile_child`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

TARGETS = (80, 89, 90)
# Shared memory one block may use (the opt-in maximum) on each target: A100, L4/L40S (sm_89), H100/H200.
SHARED_MEMORY_PER_BLOCK = {80: 166912, 89: 101376, 90: 232448}


@dataclass
class CompileSpec:
    """One specialisation of a Triton kernel: argument types, constexpr values and launch options."""

    name: str
    kernel: object
    signature: dict[str, str]
    constexprs: dict[str, object] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3
    aligned: tuple[str, ...] = ()  # pointer/int arguments specialised as divisible by 16 (enables 128-bit access)
    min_capability: int = 0  # skip targets below this (e.g. a TMA/wgmma path is sm_90-only)
    targets: tuple[int, ...] | None = None  # only these of the requested targets (None: all of them)
    report: bool = True  # ptxas report and SASS; False: compile and keep the metadata (shared memory) only


def targets_fitting(shared_bytes: int, targets=TARGETS) -> tuple[int, ...]:
    """The targets whose per-block shared memory holds `shared_bytes` (a config that does not fit a target is
    never dispatched there, so it is not compiled for it either)."""
    return tuple(t for t in targets if shared_bytes <= SHARED_MEMORY_PER_BLOCK[t])


def triton_bin(tool: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    if path.exists():
        return str(path)
    found = shutil.which(tool)
    if not found:
        raise FileNotFoundError(f"{tool} not found in triton's wheel or on PATH")
    return found


def arch_name(capability: int) -> str:
    return f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"


def parse_ptxas_log(log: str) -> dict:
    """Registers and spill bytes from `ptxas -v` output (summed over all functions in the log)."""
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", log)]
    stores = [int(m) for m in re.findall(r"(\d+) bytes spill stores", log)]
    loads = [int(m) for m in re.findall(r"(\d+) bytes spill loads", log)]
    stack = [int(m) for m in re.findall(r"(\d+) bytes stack frame", log)]
    return {
        "registers": max(regs) if regs else None,
        "spill_stores": sum(stores),
        "spill_loads": sum(loads),
        "stack_frame": max(stack) if stack else 0,
        "functions": len(regs),
    }


def triton_ptxas(capability: int) -> str:
    """The ptxas Triton itself uses for this target (newer triton wheels ship one per architecture range)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        try:
            return get_ptxas(capability).path
        except TypeError:
            return get_ptxas().path
    except ImportError:
        return triton_bin("ptxas")


def ptxas_report(ptx: str, capability: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run(
            [triton_ptxas(capability), "-v", f"--gpu-name={arch_name(capability)}", str(src),
             "-o", str(Path(tmp) / "k.o")],
            capture_output=True, text=True, timeout=120,
        )
        if out.returncode != 0:
            raise RuntimeError(f"ptxas failed: {out.stderr}")
        log = out.stdout + out.stderr
    return {**parse_ptxas_log(log), "log": log}


def sass(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([triton_bin("cuobjdump"), "-sass", str(path)], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"cuobjdump failed: {out.stderr}")
        return out.stdout


def compile_triton(spec: CompileSpec, capability: int) -> dict:
    """Compile one spec for one target; returns every stage's text plus the ptxas report."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    arg_names = list(spec.kernel.arg_names)
    attrs = {(arg_names.index(a),): [["tt.divisibility", 16]] for a in spec.aligned}
    signature = dict(spec.signature)
    for k in spec.constexprs:
        signature[k] = "constexpr"
    src = ASTSource(fn=spec.kernel, signature=signature, constexprs=dict(spec.constexprs), attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
    asm = compiled.asm
    report = ptxas_report(asm["ptx"], capability) if spec.report else {}
    return {
        "name": spec.name,
        "target": arch_name(capability),
        "ttir": asm.get("ttir", ""),
        "ttgir": asm.get("ttgir", ""),
        "llir": asm.get("llir", ""),
        "ptx": asm["ptx"],
        "sass": sass(asm["cubin"]) if spec.report else "",
        "ptxas": report,
        "shared_bytes": getattr(compiled.metadata, "shared", None),
    }


def _run_child(module: str, targets: list[int], only: str | None, out_dir: Path,
               specs: str = "compile_specs") -> None:
    mod = importlib.import_module(module)
    summary = []
    if not hasattr(mod, specs):
        for cap in targets:
            summary += mod.compile_artifacts(arch_name(cap), str(out_dir), only)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return
    for spec in getattr(mod, specs)():
        if only and spec.name != only:
            continue
        for cap in targets:
            if cap < spec.min_capability or (spec.targets is not None and cap not in spec.targets):
                continue
            result = compile_triton(spec, cap)
            stem = f"{spec.name}.{result['target']}"
            for stage in ("ttir", "ttgir", "llir", "ptx", "sass"):
                (out_dir / f"{stem}.{stage}").write_text(result[stage])
            summary.append({"name": spec.name, "target": result["target"], "files": stem,
                            "shared_bytes": result["shared_bytes"],
                            **{k: v for k, v in result["ptxas"].items() if k != "log"}})
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))


def start_compile_child(module: str, targets=TARGETS, only: str | None = None, out_dir: str | Path | None = None,
                        env: dict[str, str] | None = None, specs: str = "compile_specs") -> subprocess.Popen:
    """Start compiling `module`'s specs (the list its function `specs` returns) for `targets` in a child process
    without the interpreter, with `env` added to the environment; return its Popen for `finish_compile_child`.
    Starting early overlaps other work."""
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="kl-compile-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    child_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
    cmd = [sys.executable, "-W", "ignore", "-m", "kernel_lab.harness.compile", "--child", module, "--out",
           str(out_dir), "--targets", ",".join(str(t) for t in targets), "--specs", specs] + (
               ["--only", only] if only else [])
    proc = subprocess.Popen(cmd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.module, proc.out_dir = module, out_dir
    return proc


def finish_compile_child(proc: subprocess.Popen, timeout: int = 900) -> list[dict]:
    """Wait for `start_compile_child`'s process; return its summary (one entry per kernel and target)."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {proc.module} failed:\n{stdout[-4000:]}\n{stderr[-8000:]}")
    return json.loads((proc.out_dir / "summary.json").read_text())


def compile_module(module: str, targets=TARGETS, only: str | None = None, out_dir: str | Path | None = None,
                   specs: str = "compile_specs") -> dict:
    """Compile every CompileSpec of `module` (from its function `specs`) for `targets` in a child process
    without the interpreter.

    Returns {(name, target): {"registers", "spill_stores", "spill_loads", "shared_bytes", "ptx", "sass", ...}},
    with "dir" (where the files stay) only when `out_dir` is given; a scratch folder of its own is removed.
    """
    proc = start_compile_child(module, targets, only, out_dir, specs=specs)
    try:
        summary = finish_compile_child(proc)
        results = {}
        for entry in summary:
            stem = proc.out_dir / entry["files"]
            entry["ptx"] = stem.with_name(stem.name + ".ptx").read_text()
            entry["sass"] = stem.with_name(stem.name + ".sass").read_text()
            if out_dir is not None:
                entry["dir"] = str(proc.out_dir)
            results[(entry["name"], entry["target"])] = entry
        return results
    finally:
        if out_dir is None:  # our own scratch folder: the text is in memory now, and /tmp would keep ~10 MB a call
            shutil.rmtree(proc.out_dir, ignore_errors=True)


def check_no_spills(compiled: dict, max_registers: int = 255,
                    targets: tuple[str, ...] | None = ("sm_80", "sm_89", "sm_90a")) -> set[str]:
    """Assert that every kernel in `compile_module`'s result built without spills and within
    `max_registers`, and (unless `targets` is None) that each kernel name built for every one of `targets`.
    Returns the kernel names."""
    names = {name for name, _ in compiled}
    for (name, target), result in compiled.items():
        assert result["spill_stores"] == 0 and result["spill_loads"] == 0, (name, target, result)
        assert result["registers"] <= max_registers, (name, target, result["registers"])
    for target in targets or ():
        missing = names - {name for name, t in compiled if t == target}
        assert not missing, (target, sorted(missing))
    return names


def nvcc_compile(sources: list[str | Path], capability: int, extra: list[str] | None = None,
                 out_dir: str | Path | None = None) -> dict:
    """Build CUDA C++ to a cubin for one target with `nvcc -Xptxas -v`; returns the ptxas report and SASS."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="kl-nvcc-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cubin = out_dir / f"{Path(str(sources[0])).stem}.{arch_name(capability)}.cubin"
    gencode = f"arch=compute_{capability}{'a' if capability >= 90 else ''},code={arch_name(capability)}"
    cmd = [nvcc, "-cubin", "-std=c++17", "-O3", "-gencode", gencode, "-Xptxas", "-v", "-lineinfo",
           *(extra or []), "-o", str(cubin), *map(str, sources)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed for {arch_name(capability)}:\n{proc.stderr}")
    log = proc.stdout + proc.stderr
    return {**parse_ptxas_log(log), "log": log, "cubin": str(cubin), "sass": sass(cubin.read_bytes())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", metavar="MODULE", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--targets", default="80,89,90")
    parser.add_argument("--only")
    parser.add_argument("--specs", default="compile_specs")
    args = parser.parse_args(argv)
    _run_child(args.child, [int(t) for t in args.targets.split(",")], args.only, Path(args.out), args.specs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
