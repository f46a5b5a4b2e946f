"""Convert `kernel-lab bench serve` records of its own format (`record_type: serve_benchmark`, record_version 1)
into result records of kernel_lab/harness/results.py, in place, from their own per-request data: nothing is
re-run. Each case and the summary are computed from the stored requests by the code bench serve now runs
(kernel_lab.bench.serve.build_record); the run's duration, environment and host load are carried over. The
old format kept no per-gap times, so ITL has no case and its summary is the run's own; every recomputed
summary value is checked against the old one before anything is written.

    python tools/migrate_serve_records.py results/09_engine/serve*/*.json
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_lab.bench.serve import build_record  # noqa: E402

SERVE_FIELDS = ("label", "server_label", "device", "base_url", "endpoint", "model", "dataset", "request_rate",
                "burstiness", "max_concurrency", "host_load_avg_1m")


def convert(old: dict):
    if old.get("record_type") != "serve_benchmark" or old.get("record_version") != 1:
        raise ValueError("not a record_version 1 serve_benchmark record")
    serve = {key: old[key] for key in SERVE_FIELDS}
    record = build_record(serve, old["requests"], old["metrics"]["duration_s"], old["env"],
                          itl_ms=old["metrics"]["itl_ms"])
    record.record["serve"]["converted"] = {
        "from": "bench serve's own record format (record_type serve_benchmark, record_version 1)",
        "by": "tools/migrate_serve_records.py, from the stored requests; no re-run",
        "itl_ms": "the run's own summary: that format kept no per-gap times, so ITL has no case"}
    new = record.record["serve"]["metrics"]
    for key, value in old["metrics"].items():
        if isinstance(value, dict):
            for stat, v in value.items():
                if not math.isclose(new[key][stat], v, rel_tol=1e-9, abs_tol=1e-9):
                    raise ValueError(f"{key}.{stat}: recomputed {new[key][stat]} != stored {v}")
        elif new[key] != value and not math.isclose(new[key], value, rel_tol=1e-9):
            raise ValueError(f"{key}: recomputed {new[key]} != stored {value}")
    return record


def main(paths: list[str]) -> int:
    for name in paths:
        path = Path(name)
        record = convert(json.loads(path.read_text()))
        record.write_to(path)
        print(f"converted {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
