#!/usr/bin/env python3
"""Print the environment record that every result carries, and what is missing for each kind of run.

    python tools/environment.py [--json] [--write FILE]

--write FILE writes the JSON record to FILE and prints the readable one (the GPU suite's single probe).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_lab.harness.env import environment_record  # noqa: E402


def missing(env: dict) -> list[str]:
    notes = []
    if not env["gpu"]:
        notes.append("no CUDA GPU: Triton kernels run through the interpreter, CUDA C++ is compile-checked only")
    if not env["nvcc"]:
        notes.append("nvcc not found: CUDA C++ compile checks (projects 04/05) cannot run")
    if not env["cutlass_dsl"]:
        notes.append("nvidia-cutlass-dsl missing: CuTe GEMM (project 03) is skipped")
    if not env["vllm"]:
        notes.append("vLLM missing from this environment: project 08 runs in .venv-vllm (make plugin-test)")
    for tool, why in [("nsys", "Nsight Systems timelines"), ("ncu", "Nsight Compute profiles"),
                      ("compute-sanitizer", "memcheck/racecheck of the CUDA kernels")]:
        if not shutil.which(tool):
            notes.append(f"{tool} not on PATH: {why} unavailable")
    for mod, why in [("liger_kernel", "Liger baselines"), ("flashinfer", "FlashInfer baselines")]:
        if importlib.util.find_spec(mod) is None:
            notes.append(f"{mod} not installed: {why} are skipped")
    return notes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print only the JSON record")
    parser.add_argument("--write", metavar="FILE", help="also write the JSON record to FILE")
    args = parser.parse_args()
    env = environment_record()
    if args.write:
        Path(args.write).write_text(json.dumps(env, indent=1) + "\n")
    if args.json:
        print(json.dumps(env, indent=1))
        return 0
    width = max(len(k) for k in env)
    for key, value in env.items():
        print(f"{key.ljust(width)}  {json.dumps(value) if isinstance(value, dict) else value}")
    gaps = missing(env)
    if gaps:
        print("\nmissing:")
        for gap in gaps:
            print(f"  - {gap}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
