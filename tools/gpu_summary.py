#!/usr/bin/env python3
"""Summarise a tools/gpu_suite.sh run: one line per project with its correctness (passed/total from the
JUnit XML, or from the per-test log when pytest was killed before writing it), whether a step timed out,
failed or was skipped, its headline % of ceiling and its speedup over the named baseline (from the records).

    python tools/gpu_summary.py OUT_DIR

Reads the run's files alone, with the standard library (no torch: a cold torch import could outlast the
suite's last seconds and lose the table).
"""

from __future__ import annotations

import csv
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_plan import project_dirs  # noqa: E402


def read_steps(logs: Path) -> dict[str, dict[str, dict]]:
    """project -> step -> {rc, seconds, limit_s} from steps.tsv (empty when the suite wrote none)."""
    steps: dict[str, dict[str, dict]] = {}
    path = logs / "steps.tsv"
    if path.exists():
        for row in csv.DictReader(path.open(), delimiter="\t"):
            steps.setdefault(row["project"], {})[row["step"]] = row
    return steps


def correctness(logs: Path, project: str, pytest_step: dict | None) -> str:
    """passed/total; partial when the run timed out (from JUnit if pytest wrote it, else the per-test log)."""
    junit, progress = logs / f"{project}.junit.xml", logs / f"{project}.tests.jsonl"
    timed_out = pytest_step is not None and pytest_step["rc"] == "124"
    counts = None
    if junit.exists():
        try:
            root = ET.parse(junit).getroot()
            suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
            total = sum(int(s.get("tests", 0)) for s in suites)
            bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
            skipped = sum(int(s.get("skipped", 0)) for s in suites)
            counts = (total - bad - skipped, total - skipped, skipped)
        except ET.ParseError:
            counts = None
    if counts is None and progress.exists():
        outcomes = [json.loads(line)["outcome"] for line in progress.read_text().splitlines() if line.strip()]
        counts = (outcomes.count("passed"), len(outcomes) - outcomes.count("skipped"), outcomes.count("skipped"))
    if counts is None:
        if pytest_step is None or pytest_step["rc"] == "skipped":
            return "not run"
        return "timed out, no test finished" if timed_out else f"no results (rc {pytest_step['rc']})"
    passed, ran, skipped = counts
    text = f"{passed}/{ran}" + (f" ({skipped} skipped)" if skipped else "")
    return f"partial {text}, timed out" if timed_out else text


def headline(records: list[dict]) -> tuple[str, str]:
    for rec in records:
        h = rec.get("headline")
        if h and h.get("percent_of_ceiling") is not None:
            speed = f"{h['speedup']:.2f}x {h.get('baseline', '')}" if h.get("speedup") is not None else "-"
            return f"{h['percent_of_ceiling']:.1f}%", speed
    cases = [c for rec in records for c in rec.get("cases", []) if c.get("percent_of_ceiling") is not None]
    if not cases:
        return "-", "-"
    best = max(cases, key=lambda c: c["percent_of_ceiling"])
    speed = ", ".join(f"{v:.2f}x {k}" for k, v in best.get("speedup", {}).items()) or "-"
    return f"{best['percent_of_ceiling']:.1f}% (best case)", speed


def step_notes(steps: dict[str, dict]) -> str:
    notes = []
    for name, row in steps.items():
        if row["rc"] == "124":
            notes.append(f"{name} timed out after {row['seconds']}s")
        elif row["rc"] == "skipped":
            notes.append(f"{name} skipped ({row.get('note') or 'deadline'})")
        elif row["rc"] != "0" and name != "pytest":
            notes.append(f"{name} rc {row['rc']}")
    return "; ".join(notes) or "-"


def setup_line(steps: dict[str, dict]) -> str | None:
    """The environment and build steps in one line (the build's note says why the extension is unavailable)."""
    if not steps:
        return None
    parts = [f"{name} rc {row['rc']} in {row['seconds']}s" + (f": {row['note']}" if row.get("note") else "")
             for name, row in steps.items()]
    return "setup: " + "; ".join(parts)


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_out")
    logs = out / "logs"
    steps = read_steps(logs)
    setup = setup_line(steps.pop("setup", {}))
    if setup:
        print(setup)
    projects = list(steps) or [Path(d).name for d in project_dirs()]
    rows = [("project", "correct", "% of ceiling", "speedup vs baseline", "steps")]
    for project in projects:
        records = []
        for path in sorted((out / "results" / project).glob("*.json")):
            try:
                records.append(json.loads(path.read_text()))
            except json.JSONDecodeError:
                pass  # a record cut off mid-write by a kill
        pct, speed = headline(records)
        own = steps.get(project, {})
        rows.append((project, correctness(logs, project, own.get("pytest")), pct, speed, step_notes(own)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
