"""Result records: one JSON schema for every benchmark, validated on write and on render.

A record is the only place a performance number may come from. README and RESULTS.md quote records;
RESULTS.md is generated from them by `make results` (python -m kernel_lab.harness.results render) and an
invalid record stops the render.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from .bench import Timing
from .env import REPO_ROOT, device_label, environment_record
from .roofline import achieved_gbps, achieved_tflops, ceilings, percent_of

SCHEMA_VERSION = 1

_TIMING = {
    "type": "object",
    "required": ["median_ms", "p20_ms", "p80_ms", "min_ms", "samples", "method"],
    "properties": {k: {"type": "number", "minimum": 0} for k in ("median_ms", "p20_ms", "p80_ms", "min_ms")}
    | {"samples": {"type": "integer", "minimum": 1}, "method": {"type": "object"}},
}

SCHEMA = {
    "type": "object",
    "required": ["schema_version", "project", "benchmark", "env", "ceilings", "cases"],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "project": {"type": "string", "pattern": r"^\d\d_[a-z0-9_]+$"},
        "benchmark": {"type": "string", "minLength": 1},
        "description": {"type": "string"},
        "env": {"type": "object", "required": ["date", "torch", "gpu", "python"]},
        "ceilings": {"type": "object"},
        "headline": {"type": "object"},
        "correctness": {
            "type": "object",
            "required": ["passed", "total"],
            "properties": {"passed": {"type": "integer"}, "total": {"type": "integer"}},
        },
        "cases": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "shape", "dtype", "timing", "metric"],
                "properties": {
                    "name": {"type": "string"},
                    "shape": {"type": "object"},
                    "dtype": {"type": "string"},
                    "timing": _TIMING,
                    "metric": {
                        "type": "object",
                        "required": ["unit", "value"],
                        "properties": {"unit": {"enum": ["GB/s", "TFLOP/s", "tok/s", "ms", "us"]},
                                       "value": {"type": "number"}},
                    },
                    "percent_of_ceiling": {"type": ["number", "null"]},
                    "ceiling": {"type": ["string", "null"]},
                    "baselines": {
                        "type": "object",
                        "additionalProperties": {
                            "type": "object",
                            "required": ["timing"],
                            "properties": {"timing": _TIMING},
                        },
                    },
                    "speedup": {"type": "object", "additionalProperties": {"type": "number"}},
                },
            },
        },
    },
}


class InvalidRecord(ValueError):
    """A record that does not follow SCHEMA."""


def validate(record: dict) -> bool:
    """Check `record` against SCHEMA (raises InvalidRecord). Returns False, having checked nothing, where
    jsonschema is not installed: the bare GPU box writes its records unvalidated, and the machine that
    commits them validates them (`make check` renders every record)."""
    try:
        import jsonschema
    except ImportError:
        return False
    try:
        jsonschema.validate(record, SCHEMA)
    except jsonschema.ValidationError as exc:
        raise InvalidRecord(exc.message) from exc
    return True


def slug(text: str) -> str:
    """Lower-case letters and digits, every other run of characters one '-': a record's file name."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


class ResultRecord:
    """Collects benchmark cases, derives GB/s or TFLOP/s and % of the measured ceiling, prints a table,
    and writes one validated JSON record."""

    def __init__(self, project: str, benchmark: str, device, description: str = "", *, env: dict | None = None,
                 ceilings_record: dict | None = None):
        """`env` and `ceilings_record` default to this machine's, measured now; a record rebuilt from an
        earlier run's raw data passes that run's environment, and one whose metrics have no roofline (serving
        latencies) passes `ceilings_record={}` rather than measure the machine."""
        import torch

        self.device = torch.device(device)
        self.env = environment_record() if env is None else env
        self.ceilings = ceilings(self.device) if ceilings_record is None else ceilings_record
        self.record = {
            "schema_version": SCHEMA_VERSION,
            "project": project,
            "benchmark": benchmark,
            "description": description,
            "env": self.env,
            "ceilings": self.ceilings,
            "cases": [],
        }

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def add_case(
        self,
        name: str,
        *,
        shape: dict,
        dtype: str,
        timing: Timing,
        nbytes: int | None = None,
        flops: float | None = None,
        baselines: dict[str, Timing] | None = None,
        extra: dict | None = None,
    ) -> dict:
        if nbytes is not None:
            value = achieved_gbps(nbytes, timing.median_ms)
            metric = {"unit": "GB/s", "value": value, "bytes": nbytes}
            ceiling_name, pct = "copy", percent_of(value, self.ceilings["copy"]["GBps"])
        elif flops is not None:
            value = achieved_tflops(flops, timing.median_ms)
            metric = {"unit": "TFLOP/s", "value": value, "flops": flops}
            ceiling_name, pct = "matmul", percent_of(value, self.ceilings["matmul"]["TFLOPs"])
        else:
            metric = {"unit": "us", "value": timing.median_ms * 1e3}
            ceiling_name, pct = None, None
        case = {
            "name": name,
            "shape": shape,
            "dtype": dtype,
            "timing": timing.to_dict(),
            "metric": metric,
            "percent_of_ceiling": pct,
            "ceiling": ceiling_name,
            "baselines": {k: {"timing": v.to_dict()} for k, v in (baselines or {}).items()},
            "speedup": {k: v.median_ms / timing.median_ms for k, v in (baselines or {}).items()},
        }
        if extra:
            case.update(extra)
        self.record["cases"].append(case)
        return case

    def set_headline(self, text: str, **values) -> None:
        self.record["headline"] = {"text": text, **values}

    def set_correctness(self, passed: int, total: int) -> None:
        self.record["correctness"] = {"passed": passed, "total": total}

    def table(self) -> str:
        cases = self.record["cases"]
        base_names = sorted({b for c in cases for b in c["baselines"]})
        head = ["case", "dtype", "median us", "p20 us", "p80 us", "metric", "% ceil"] + [f"x {b}" for b in base_names]
        rows = []
        for c in cases:
            t, m = c["timing"], c["metric"]
            pct = c["percent_of_ceiling"]
            rows.append([
                c["name"], c["dtype"], f"{t['median_ms'] * 1e3:.1f}", f"{t['p20_ms'] * 1e3:.1f}",
                f"{t['p80_ms'] * 1e3:.1f}", f"{m['value']:.1f} {m['unit']}", "-" if pct is None else f"{pct:.1f}",
            ] + [f"{c['speedup'][b]:.2f}" if b in c["speedup"] else "-" for b in base_names])
        widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
        label = device_label(self.env) + ("" if self.on_gpu else "  [CPU run: functional only, not a GPU result]")
        lines = [f"{self.record['project']} / {self.record['benchmark']} on {label}"]
        lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        lines += ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)) for r in rows]
        return "\n".join(lines)

    def emit(self, out_dir: str | Path | None) -> Path | None:
        """Print the table, then validate and write the record (when out_dir is given)."""
        print(self.table())
        print()
        path = self.write(out_dir)
        if path:
            print(f"wrote {path}")
        return path

    def write(self, out_dir: str | Path | None) -> Path | None:
        validate(self.record)
        if out_dir is None:
            return None
        out_dir = Path(out_dir) / self.record["project"]
        return self.write_to(out_dir / f"{slug(self.record['benchmark'])}-{slug(device_label(self.env))}.json")

    def write_to(self, path: str | Path) -> Path:
        """Validate and write the record to exactly `path` (for a benchmark that names its own files)."""
        validate(self.record)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.record, indent=1, sort_keys=True) + "\n")
        return path


def load_records(results_dir: Path) -> list[tuple[Path, dict]]:
    records = []
    for path in sorted(results_dir.rglob("*.json")):
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or "schema_version" not in record:
            continue  # non-benchmark JSON (e.g. a raw per-run dump) lives beside records
        try:
            validate(record)
        except InvalidRecord as exc:
            raise SystemExit(f"invalid result record {path}: {exc}") from exc
        records.append((path, record))
    return records


PROJECTS = [
    "01_rmsnorm", "02_swiglu", "03_gemm", "04_paged_decode", "05_fp8_kv", "06_topk_sampling", "07_moe",
    "08_vllm_plugin", "09_engine", "10_speculative", "11_multi_lora",
]


def render(results_dir: Path) -> str:
    records = load_records(results_dir)
    out = [
        "# Results",
        "",
        "Generated by `make results` from the JSON records under `results/`. Do not edit by hand.",
        "Every number below is a median over timed calls; p20/p80 give the spread. `% ceil` is the percent",
        "of the ceiling measured on the same device in the same run (copy bandwidth or bf16 cuBLAS matmul).",
        "",
    ]
    for project in PROJECTS:
        out.append(f"## {project}")
        out.append("")
        gpu_records = [(p, r) for p, r in records if r["project"] == project and r["env"].get("gpu")]
        cpu_records = [(p, r) for p, r in records if r["project"] == project and not r["env"].get("gpu")]
        if not gpu_records:
            out.append("**Not yet measured on a GPU.**")
            out.append("")
        for path, r in gpu_records + cpu_records:
            env = r["env"]
            where = device_label(env)
            versions = f"torch {env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda_runtime')}"
            if env.get("gpu"):
                versions += f", driver {env['gpu'].get('driver')}"
            out.append(f"### {r['benchmark']} — {where}" + ("" if env.get("gpu") else " (CPU, functional only)"))
            out.append("")
            out.append(f"Record: `{path.relative_to(results_dir.parent)}` · {versions} · commit "
                       f"`{(env.get('git_commit') or '?')[:12]}` · {env.get('date')}")
            if r.get("headline"):
                out.append("")
                out.append(f"Headline: {r['headline']['text']}")
            if r.get("correctness"):
                passed, total = r["correctness"]["passed"], r["correctness"]["total"]
                out.append(f"Correctness on this device: {passed}/{total} passed")
            out.append("")
            base_names = sorted({b for c in r["cases"] for b in c.get("baselines", {})})
            out.append("| case | dtype | median | p20 | p80 | metric | % ceil | " +
                       " | ".join(f"× {b}" for b in base_names) + (" |" if base_names else ""))
            out.append("|" + "---|" * (7 + len(base_names)))
            for c in r["cases"]:
                t, m = c["timing"], c["metric"]
                pct = c.get("percent_of_ceiling")
                cells = [c["name"], c["dtype"], f"{t['median_ms'] * 1e3:.1f} µs", f"{t['p20_ms'] * 1e3:.1f}",
                         f"{t['p80_ms'] * 1e3:.1f}", f"{m['value']:.1f} {m['unit']}",
                         "-" if pct is None else f"{pct:.1f}%"]
                cells += [f"{c['speedup'][b]:.2f}×" if b in c.get("speedup", {}) else "-" for b in base_names]
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
        plots = sorted((results_dir / project).glob("*.png")) if (results_dir / project).exists() else []
        for png in plots:
            out.append(f"![{png.stem}]({png.relative_to(results_dir.parent)})")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="validate result records and render RESULTS.md")
    parser.add_argument("command", choices=["render", "validate"])
    parser.add_argument("--results", default=str(REPO_ROOT / "results"))
    parser.add_argument("--output", default=str(REPO_ROOT / "RESULTS.md"))
    parser.add_argument("--check", action="store_true", help="fail if RESULTS.md is not up to date")
    args = parser.parse_args(argv)
    results_dir = Path(args.results)
    if args.command == "validate":
        print(f"{len(load_records(results_dir))} valid records")
        return 0
    text = render(results_dir)
    output = Path(args.output)
    if args.check:
        if not output.exists() or output.read_text() != text:
            print("RESULTS.md is stale: run `make results`", file=sys.stderr)
            return 1
        return 0
    output.write_text(text)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
