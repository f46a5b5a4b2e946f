"""Figures from `kernel-lab bench serve` records (matplotlib, PNG).

    python -m kernel_lab.bench.plots results/09_engine/serve/*.json --out projects/09_engine/server/figures

- throughput_vs_concurrency.png: output tokens/s and requests/s against --max-concurrency, one line per
  server label (only records of the same workload are drawn together: the first workload found, or
  the one named with --workload).
- latency_percentiles.png: median / p90 / p99 of TTFT, TPOT, ITL and E2EL against concurrency.

Every figure is titled with the device the records were measured on (from the records' environment);
records from different devices are never mixed in one figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from .serve import serve_block


def load_serve_records(paths: list[str]) -> list[dict]:
    """The `serve` blocks of the bench serve records among `paths` (files or directories), each with its
    record's file in `_path`."""
    records = []
    for pattern in paths:
        path = Path(pattern)
        files = sorted(path.rglob("*.json")) if path.is_dir() else [path]
        for file in files:
            try:
                serve = serve_block(json.loads(file.read_text()))
            except (OSError, json.JSONDecodeError):
                continue
            if serve is not None:
                records.append({**serve, "_path": str(file)})
    return records


def workload_key(record: dict) -> str:
    d = record["dataset"]
    return (
        f"{d['name']} in={d['input_len']} out={d['output_len']} ratio={d['range_ratio']} "
        f"n={d['num_prompts']} rate={record['request_rate']} {record['endpoint']}"
    )


def _select(records: list[dict], workload: str | None) -> tuple[list[dict], str]:
    if not records:
        raise ValueError("no bench serve records found")
    key = workload or workload_key(records[0])
    chosen = [r for r in records if workload_key(r) == key and r.get("max_concurrency")]
    devices = {r["device"] for r in chosen}
    if len(devices) > 1:
        raise ValueError(f"records from different devices cannot share a figure: {sorted(devices)}")
    if not chosen:
        raise ValueError(f"no records with a --max-concurrency for workload {key!r}")
    return chosen, key


def _by_server(records: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[r["server_label"]].append(r)
    for rs in groups.values():
        rs.sort(key=lambda r: r["max_concurrency"])
    return dict(sorted(groups.items()))


def plot(records: list[dict], out_dir: Path, workload: str | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen, key = _select(records, workload)
    loads = [v for r in chosen for v in (r.get("host_load_avg_1m") or {}).values()]
    device = chosen[0]["device"] + (f"; host load average {min(loads):.1f} to {max(loads):.1f}" if loads else "")
    groups = _by_server(chosen)
    levels = sorted({r["max_concurrency"] for r in chosen})
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, rs in groups.items():
        xs = [r["max_concurrency"] for r in rs]
        axes[0].plot(xs, [r["metrics"]["output_throughput"] for r in rs], marker="o", label=label)
        axes[1].plot(xs, [r["metrics"]["request_throughput"] for r in rs], marker="o", label=label)
    for ax, ylabel in zip(axes, ("output tokens/s", "requests/s"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(level) for level in levels])
        ax.set_xlabel("max concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"Serving throughput vs concurrency: {device}\n{key}", fontsize=9)
    fig.tight_layout()
    path = out_dir / "throughput_vs_concurrency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    metrics = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL"))
    fig, axes = plt.subplots(1, 4, figsize=(16, 4.2))
    styles = {"median": "-", "p90": "--", "p99": ":"}
    for ax, (metric, title) in zip(axes, metrics, strict=True):
        for i, (label, rs) in enumerate(groups.items()):
            xs = [r["max_concurrency"] for r in rs]
            for stat, style in styles.items():
                ax.plot(
                    xs,
                    [r["metrics"][metric][stat] for r in rs],
                    style,
                    marker="o",
                    color=f"C{i}",
                    label=f"{label} {stat}",
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(level) for level in levels])
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Latency percentiles (median, p90, p99): {device}\n{key}", fontsize=9)
    fig.tight_layout()
    path = out_dir / "latency_percentiles.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def table(records: list[dict], workload: str | None = None) -> str:
    """A markdown table of the chosen records (for the project page)."""
    chosen, key = _select(records, workload)
    lines = [
        f"Workload: {key}. Device: {chosen[0]['device']}.",
        "",
        "| server | concurrency | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
        "E2EL p50 / p99 ms | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, rs in _by_server(chosen).items():
        for r in rs:
            m = r["metrics"]
            lines.append(
                f"| {label} | {r['max_concurrency']} | {m['request_throughput']:.2f} | {m['output_throughput']:.1f} "
                f"| {m['ttft_ms']['median']:.0f} / {m['ttft_ms']['p99']:.0f} "
                f"| {m['tpot_ms']['median']:.0f} / {m['tpot_ms']['p99']:.0f} "
                f"| {m['e2el_ms']['median']:.0f} / {m['e2el_ms']['p99']:.0f} | {m['failed']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernel_lab.bench.plots", description=__doc__.split("\n")[0])
    parser.add_argument("records", nargs="+", help="record files or directories")
    parser.add_argument("--out", default=".", help="directory for the PNG files")
    parser.add_argument("--workload", default=None, help="workload key to draw (default: the first found)")
    parser.add_argument("--table", action="store_true", help="also print a markdown table")
    args = parser.parse_args(argv)
    try:
        records = load_serve_records(args.records)
        for path in plot(records, Path(args.out), args.workload):
            print(f"wrote {path}")
        if args.table:
            print(table(records, args.workload))
    except ValueError as exc:
        print(f"plots: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
