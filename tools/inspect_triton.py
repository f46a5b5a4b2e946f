#!/usr/bin/env python3
"""Show the code Triton generates for one of our kernels, without a GPU.

    python tools/inspect_triton.py rmsnorm --target sm_90 --stage sass [--spec NAME] [--grep REGEX]
    python tools/inspect_triton.py rmsnorm --list

KERNEL is an ops module name (rmsnorm, swiglu, gemm, sampling, moe); its `compile_specs()` lists the
specialisations. Every stage of every spec is written under --out; the chosen stage is printed, followed
by ptxas' register and spill report.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_lab.harness.compile import compile_module  # noqa: E402

STAGES = ("ttir", "ttgir", "llir", "ptx", "sass")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", help="ops module, e.g. rmsnorm")
    parser.add_argument("--target", default="sm_90", choices=["sm_80", "sm_89", "sm_90"])
    parser.add_argument("--stage", default="ptx", choices=STAGES)
    parser.add_argument("--spec", help="one specialisation (default: the first)")
    parser.add_argument("--grep", help="print only lines matching this regex")
    parser.add_argument("--list", action="store_true", help="list the specialisations and exit")
    parser.add_argument("--out", help="directory for all stages (default: a temporary one)")
    args = parser.parse_args(argv)
    module = f"kernel_lab.ops.{args.kernel}"
    try:
        specs = importlib.import_module(module).compile_specs()
    except (ImportError, AttributeError) as exc:
        parser.error(f"{module} has no compile_specs(): {exc}")
    if args.list:
        for spec in specs:
            print(f"{spec.name}  (num_warps={spec.num_warps}, constexprs={spec.constexprs})")
        return 0
    name = args.spec or specs[0].name
    if name not in {s.name for s in specs}:
        parser.error(f"unknown spec {name!r}; use --list")
    capability = int(args.target.split("_")[1])
    out = Path(args.out or tempfile.mkdtemp(prefix="kl-inspect-"))
    results = compile_module(module, targets=(capability,), only=name, out_dir=out)
    (result,) = results.values()
    text = (out / f"{result['files']}.{args.stage}").read_text()
    if args.grep:
        pattern = re.compile(args.grep)
        text = "\n".join(line for line in text.splitlines() if pattern.search(line))
    print(text)
    print(f"\n# {name} on {result['target']}: {result['registers']} registers, "
          f"{result['spill_stores']} B spill stores, {result['spill_loads']} B spill loads; all stages in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
