#!/usr/bin/env python3
"""Summarise a tools/gpu_suite.sh run: one line per project with its correctness (passed/total from the
JUnit XML), its headline % of ceiling and its speedup over the named baseline (from the records).

    python tools/gpu_summary.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_lab.harness.results import PROJECTS  # noqa: E402


def correctness(junit: Path) -> str:
    if not junit.exists():
        return "not run"
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = sum(int(s.get("tests", 0)) for s in suites)
    bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return f"{total - bad - skipped}/{total - skipped}" + (f" ({skipped} skipped)" if skipped else "")


def headline(records: list[dict]) -> tuple[str, str]:
    for rec in records:
        h = rec.get("headline")
        if h and h.get("percent_of_ceiling") is not None:
            speed = f"{h['speedup']:.2f}x {h.get('baseline', '')}" if h.get("speedup") is not None else "-"
            return f"{h['percent_of_ceiling']:.1f}%", speed
    cases = [c for rec in records for c in rec["cases"] if c.get("percent_of_ceiling") is not None]
    if not cases:
        return "-", "-"
    best = max(cases, key=lambda c: c["percent_of_ceiling"])
    speed = ", ".join(f"{v:.2f}x {k}" for k, v in best.get("speedup", {}).items()) or "-"
    return f"{best['percent_of_ceiling']:.1f}% (best case)", speed


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_out")
    rows = [("project", "correct", "% of ceiling", "speedup vs baseline")]
    for project in PROJECTS:
        records = [json.loads(p.read_text()) for p in sorted((out / "results" / project).glob("*.json"))]
        pct, speed = headline(records)
        rows.append((project, correctness(out / "logs" / f"{project}.junit.xml"), pct, speed))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
