"""`kernel-lab bench serve`: an online serving benchmark against any OpenAI-compatible server, modelled on
`vllm bench serve`.

    kernel-lab bench serve --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 64 --random-output-len 32 --num-prompts 64 --max-concurrency 1,4,16 \\
        --server-label kernel-lab --result-dir results/09_engine/serve

Workload (the flags and length rule `bench throughput` shares, bench/workload.py): `random` draws each
request's input and output length uniformly from [len * (1 - r), len * (1 + r)] for --random-range-ratio r
(default 0, as vLLM's); `fixed` uses exactly --random-input-len / --random-output-len.
Prompts are random token ids decoded to text with the model's tokenizer and re-encoded until they have
the intended length, so every server sees the same text. Output lengths are enforced with `max_tokens`
and `ignore_eos` (a vLLM extension both servers accept; pass --no-ignore-eos for servers that refuse it).

Arrivals: --request-rate R sends a Poisson process (gamma intervals with --burstiness) of R requests/s;
`inf` sends them all at once. --max-concurrency caps requests in flight; a comma list runs one
benchmark per value (for the throughput-vs-concurrency plot).

Metrics per request, from the client's clock: TTFT (send to the first non-empty text chunk), ITL (gaps
between text chunks), TPOT ((E2EL - TTFT) / (output tokens - 1)), E2EL (send to the end of the stream).
Token counts come from the server's usage (stream_options.include_usage). Aggregates: request
throughput, output and total token throughput, and mean / median / p90 / p99 of each latency.

Each run is one result record of kernel_lab/harness/results.py, like every other benchmark's (schema_version,
environment, a case per metric with its median / p20 / p80 / min and method: TTFT, TPOT, ITL, E2EL and output
tok/s), plus a `serve` block: the workload, the server, vLLM's summary (mean / median / p90 / p99, throughputs)
and every request's lengths and latencies, from which the rest is computed. `make results` renders the records
into RESULTS.md; `python -m kernel_lab.bench.plots` draws figures from them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kernel_lab.harness.bench import quantile
from kernel_lab.harness.bench import summarize as timing_of
from kernel_lab.harness.results import ResultRecord, slug

from .workload import add_workload_arguments, draw_length, load_tokenizer

PROJECT = "09_engine"
PERCENTILES = (50, 90, 99)
# (summary key, case name, what the client's clock measures)
LATENCIES = (
    ("ttft_ms", "TTFT", "send to the first non-empty text chunk"),
    ("tpot_ms", "TPOT", "per request, (E2EL - TTFT) / (output tokens - 1)"),
    ("itl_ms", "ITL", "gaps between text chunks"),
    ("e2el_ms", "E2EL", "send to the end of the stream"),
)


# ====================================================================== workload
@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int


def _prompt_of_length(tokenizer, rng: random.Random, length: int, candidates: list[int]) -> tuple[str, int]:
    """Random token ids decoded to text whose re-encoding (without special tokens) has `length` tokens;
    retokenisation merges or splits a few tokens, so top up or trim and retry a few times."""
    ids = [rng.choice(candidates) for _ in range(length)]
    text = tokenizer.decode(ids)
    for _ in range(8):
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == length:
            break
        if len(encoded) > length:
            encoded = encoded[:length]
        else:
            encoded = encoded + [rng.choice(candidates) for _ in range(length - len(encoded))]
        text = tokenizer.decode(encoded)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def build_workload(
    tokenizer,
    *,
    dataset: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[BenchRequest]:
    if dataset not in ("random", "fixed"):
        raise ValueError(f"dataset must be 'random' or 'fixed', got {dataset!r}")
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, input_len and output_len must be at least 1")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    ratio = range_ratio if dataset == "random" else 0.0
    rng = random.Random(seed)
    special = tokenizer.all_special_ids
    # Plain-text tokens only: skip special ids and the byte-level single-byte range at the bottom.
    candidates = [i for i in range(min(256, tokenizer.vocab_size // 2), tokenizer.vocab_size) if i not in special]
    requests = []
    for _ in range(num_prompts):
        n_in, n_out = draw_length(rng, input_len, ratio), draw_length(rng, output_len, ratio)
        text, actual = _prompt_of_length(tokenizer, rng, n_in, candidates)
        requests.append(BenchRequest(text, actual, n_out))
    return requests


def arrival_delays(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: zeros for an infinite rate, else gamma-distributed gaps with
    mean 1/rate (burstiness 1 is a Poisson process; lower is burstier)."""
    if request_rate == float("inf"):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be positive")
    rng = random.Random(seed ^ 0x5EED)
    return [rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness)) for _ in range(n)]


# ====================================================================== client
@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""
    text: str = ""


# The JSON-schema workload: every request's output is constrained to this schema (a long array of short
# records, so that a grammar-constrained output can run as long as a free one), through the structured-output
# field of the endpoint: response_format on chat, vLLM's structured_outputs on completions.
BENCH_JSON_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24}},
        "required": ["id", "name"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False,
}
STRUCTURED_OUTPUTS = ("none", "json-schema")


def structured_output_fields(kind: str, chat: bool) -> dict:
    """The request fields of a `--structured-output` workload ({} for none)."""
    if kind == "none":
        return {}
    if kind != "json-schema":
        raise ValueError(f"structured output must be one of {STRUCTURED_OUTPUTS}, got {kind!r}")
    if chat:
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "bench", "schema": BENCH_JSON_SCHEMA, "strict": True}}}
    return {"structured_outputs": {"json": BENCH_JSON_SCHEMA}}


async def send_request(
    client,
    url: str,
    endpoint: str,
    model: str,
    request: BenchRequest,
    *,
    ignore_eos: bool,
    api_key: str | None,
    timeout_s: float,
    structured_output: str = "none",
) -> RequestResult:
    chat = endpoint.endswith("/chat/completions")
    payload = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    if ignore_eos:
        payload["ignore_eos"] = True
    payload.update(structured_output_fields(structured_output, chat))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = RequestResult(prompt_len=request.prompt_len)
    chunks: list[str] = []
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url + endpoint, json=payload, headers=headers, timeout=timeout_s) as rsp:
            if rsp.status_code != 200:
                body = (await rsp.aread()).decode(errors="replace")
                result.error = f"HTTP {rsp.status_code}: {body[:300]}"
                return result
            usage = None
            async for line in rsp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"in-stream error: {event['error']}"
                    return result
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        now = time.perf_counter()
                        if not chunks:
                            result.ttft_s = now - start
                        else:
                            result.itl_s.append(now - last)
                        last = now
                        chunks.append(text)
            result.e2el_s = time.perf_counter() - start
            result.text = "".join(chunks)
            if usage:
                result.output_tokens = int(usage.get("completion_tokens") or 0)
                result.prompt_len = int(usage.get("prompt_tokens") or request.prompt_len)
            else:  # a server without usage in streams: one token per chunk is the best guess
                result.output_tokens = len(chunks)
            result.success = bool(chunks) or result.output_tokens > 0
            if not result.success:
                result.error = "empty completion"
    except Exception as exc:  # noqa: BLE001 - a failed request is data, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_benchmark(
    base_url: str,
    endpoint: str,
    model: str,
    requests: list[BenchRequest],
    *,
    request_rate: float,
    burstiness: float,
    max_concurrency: int | None,
    seed: int,
    ignore_eos: bool,
    api_key: str | None,
    timeout_s: float = 600.0,
    progress: bool = False,
    structured_output: str = "none",
) -> tuple[list[RequestResult], float]:
    import httpx

    limit = max_concurrency or len(requests)
    semaphore = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    delays = arrival_delays(len(requests), request_rate, burstiness, seed)
    done = 0

    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:

        async def one(request: BenchRequest) -> RequestResult:
            nonlocal done
            async with semaphore:
                result = await send_request(
                    client,
                    base_url,
                    endpoint,
                    model,
                    request,
                    ignore_eos=ignore_eos,
                    api_key=api_key,
                    timeout_s=timeout_s,
                    structured_output=structured_output,
                )
            done += 1
            if progress:
                print(f"\r  {done}/{len(requests)} requests", end="", file=sys.stderr, flush=True)
            return result

        start = time.perf_counter()
        tasks = []
        for request, delay in zip(requests, delays, strict=False):
            if delay:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if progress:
        print(file=sys.stderr)
    return list(results), duration


# ====================================================================== summary
def _percentile(values: list[float], q: float) -> float:
    return quantile(sorted(values), q / 100.0) if values else 0.0


def _stats_ms(ms: list[float]) -> dict:
    out = {
        "mean": statistics.fmean(ms) if ms else 0.0,
        "median": statistics.median(ms) if ms else 0.0,
        "std": statistics.pstdev(ms) if len(ms) > 1 else 0.0,
        "count": len(ms),
    }
    for q in PERCENTILES:
        out[f"p{q}"] = _percentile(ms, q)
    return out


def request_rows(results: list[RequestResult]) -> list[dict]:
    """The per-request data a record keeps (milliseconds), from which its summary and cases are computed."""
    rows = []
    for r in results:
        row = {"prompt_len": r.prompt_len, "output_tokens": r.output_tokens, "ttft_ms": r.ttft_s * 1e3,
               "e2el_ms": r.e2el_s * 1e3, "itl_ms": [gap * 1e3 for gap in r.itl_s], "success": r.success}
        if r.error:
            row["error"] = r.error
        rows.append(row)
    return rows


def latency_samples(rows: list[dict]) -> dict[str, list[float]]:
    """Each latency's samples (ms) over the successful requests; ITL only where the rows carry their gaps."""
    ok = [r for r in rows if r["success"]]
    samples = {
        "ttft_ms": [r["ttft_ms"] for r in ok],
        "tpot_ms": [(r["e2el_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1],
        "e2el_ms": [r["e2el_ms"] for r in ok],
    }
    if all("itl_ms" in r for r in ok):
        samples["itl_ms"] = [gap for r in ok for gap in r["itl_ms"]]
    return samples


def summarize_rows(rows: list[dict], duration_s: float) -> dict:
    """vLLM's summary of a run: counts, throughputs, and mean / median / std / p50 / p90 / p99 per latency."""
    ok = [r for r in rows if r["success"]]
    input_tokens = sum(r["prompt_len"] for r in ok)
    output_tokens = sum(r["output_tokens"] for r in ok)
    summary = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(rows) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_throughput": output_tokens / duration_s if duration_s else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s if duration_s else 0.0,
        "errors": sorted({r.get("error", "") for r in rows if not r["success"]})[:10],
    }
    summary.update({key: _stats_ms(values) for key, values in latency_samples(rows).items()})
    return summary


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    return summarize_rows(request_rows(results), duration_s)


def record_title(serve: dict) -> str:
    d = serve["dataset"]
    structured = d.get("structured_output", "none")
    return (f"bench serve, {serve['server_label']}: {d['name']} {d['input_len']} in / {d['output_len']} out"
            f"{'' if structured == 'none' else ', ' + structured}, {serve['endpoint']}, concurrency "
            f"{serve['max_concurrency'] or 'unlimited'}, rate {serve['request_rate']}")


def build_record(serve: dict, rows: list[dict], duration_s: float, env: dict, itl_ms: dict | None = None):
    """One run as a harness ResultRecord: a case per latency (its samples' median / p20 / p80 / min, the
    metric its median in ms) and one for output tok/s (the run's wall clock), no ceiling (none applies to
    serving latency), and the `serve` block: `serve` (workload, server, host load) with the summary and
    the rows. `itl_ms`: the ITL summary of rows that carry no gaps (records converted from bench serve's
    own format, which kept only that summary)."""
    metrics = summarize_rows(rows, duration_s)
    if itl_ms is not None:
        metrics["itl_ms"] = itl_ms
    d = serve["dataset"]
    record = ResultRecord(PROJECT, record_title(serve), "cpu", env=env, ceilings_record={},
                          description=f"kernel-lab bench serve against {serve['server_label']} ({serve['model']}) "
                                      f"at {serve['base_url']}, {serve['device']}; latencies from the client's "
                                      "clock, token counts from the server's usage" +
                                      (f"; {serve['label']}" if serve.get("label") else ""))
    shape = {"dataset": d["name"], "num_prompts": d["num_prompts"], "input_len": d["input_len"],
             "output_len": d["output_len"], "range_ratio": d["range_ratio"],
             "structured_output": d.get("structured_output", "none"), "endpoint": serve["endpoint"],
             "max_concurrency": serve["max_concurrency"], "request_rate": serve["request_rate"]}
    completed, samples = metrics["completed"], latency_samples(rows)
    for key, name, what in LATENCIES:
        values = samples.get(key)
        if values:
            timing = timing_of(values, {"kind": f"{name}: {what}", "clock": "client, time.perf_counter",
                                        "requests": completed})
            stats = metrics[key]
            record.add_case(name, shape=shape, dtype="as served", timing=timing,
                            extra={"metric": {"unit": "ms", "value": timing.median_ms},
                                   "summary_ms": {k: stats[k] for k in ("mean", "p90", "p99")}})
    run = timing_of([duration_s * 1e3], {"kind": "the run's wall clock, first send to last response",
                                         "requests": len(rows)})
    record.add_case("output tok/s", shape=shape, dtype="as served", timing=run,
                    extra={"metric": {"unit": "tok/s", "value": metrics["output_throughput"]},
                           "request_throughput": metrics["request_throughput"]})
    record.set_headline(f"{metrics['output_throughput']:.1f} output tok/s, median TTFT "
                        f"{metrics['ttft_ms']['median']:.0f} ms, median TPOT {metrics['tpot_ms']['median']:.1f} ms, "
                        f"{metrics['failed']} failed", output_tok_s=metrics["output_throughput"])
    record.record["serve"] = {**serve, "metrics": metrics, "requests": rows}
    return record


def serve_block(record: dict) -> dict | None:
    """The `serve` block of a bench serve record (None for any other JSON)."""
    if isinstance(record, dict) and "schema_version" in record and isinstance(record.get("serve"), dict):
        return record["serve"]
    return None


def format_summary(record: dict) -> str:
    """vLLM's printed summary of a record's `serve` block."""
    m = record["metrics"]
    lines = [
        f"============ Serving Benchmark Result ({record['server_label']}, {record['device']}) ============",
        f"{'Max concurrency:':<40}{record['max_concurrency'] or 'unlimited'}",
        f"{'Host load average (start, end):':<40}{record['host_load_avg_1m']['start']:.1f}, "
        f"{record['host_load_avg_1m']['end']:.1f}",
        f"{'Request rate (req/s):':<40}{record['request_rate']}",
        f"{'Successful requests:':<40}{m['completed']}",
        f"{'Failed requests:':<40}{m['failed']}",
        f"{'Benchmark duration (s):':<40}{m['duration_s']:.2f}",
        f"{'Total input tokens:':<40}{m['total_input_tokens']}",
        f"{'Total generated tokens:':<40}{m['total_output_tokens']}",
        f"{'Request throughput (req/s):':<40}{m['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<40}{m['output_throughput']:.2f}",
        f"{'Total token throughput (tok/s):':<40}{m['total_token_throughput']:.2f}",
    ]
    for key, title in (
        ("ttft_ms", "Time to First Token"),
        ("tpot_ms", "Time per Output Token (excl. 1st)"),
        ("itl_ms", "Inter-token Latency"),
        ("e2el_ms", "End-to-end Latency"),
    ):
        s = m[key]
        lines.append(f"{('-' * 12 + title + '-' * 12):-^60}")
        for stat in ("mean", "median", "p90", "p99"):
            lines.append(f"{stat.capitalize() + ' ' + key.split('_')[0].upper() + ' (ms):':<40}{s[stat]:.2f}")
    for error in m["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


# ====================================================================== entry points
def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json, a directory holding one, or a model (a GGUF file or a Hugging Face directory); "
             "default: the bundled model's",
    )
    add_workload_arguments(parser, num_prompts=64, input_len=128, output_len=32)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s of a Poisson arrival process (default inf: all at once)",
    )
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument(
        "--max-concurrency",
        default=None,
        help="cap on requests in flight; a comma list runs one benchmark per value",
    )
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--structured-output", default="none", choices=STRUCTURED_OUTPUTS,
                        help="json-schema: constrain every output to BENCH_JSON_SCHEMA (compare with none for the "
                             "cost of structured output)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    parser.add_argument(
        "--server-label",
        default=None,
        help="name of the server in records and plots (default: the model's owner/root)",
    )
    parser.add_argument("--result-dir", default=None, help="write one JSON record per run here")
    parser.add_argument("--label", default="", help="free text stored in the record")
    from .serve_pair import add_pair_arguments

    add_pair_arguments(parser)


def _concurrency_levels(spec: str | None) -> list[int | None]:
    if spec in (None, ""):
        return [None]
    levels = [int(x) for x in str(spec).split(",") if x.strip()]
    if any(level < 1 for level in levels):
        raise ValueError("--max-concurrency values must be at least 1")
    return levels


def _discover_model(base_url: str, api_key: str | None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rsp = httpx.get(base_url + "/v1/models", headers=headers, timeout=30)
    rsp.raise_for_status()
    return rsp.json()["data"][0]


def benchmark_once(
    args,
    requests: list[BenchRequest],
    model: str,
    server_label: str,
    concurrency: int | None,
    env: dict,
    device: str,
):
    """One run at one concurrency: its ResultRecord (build_record)."""
    load_before = os.getloadavg()[0]
    results, duration = asyncio.run(
        run_benchmark(
            args.base_url,
            args.endpoint,
            model,
            requests,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=concurrency,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            api_key=args.api_key,
            timeout_s=args.timeout,
            progress=sys.stderr.isatty(),
            structured_output=args.structured_output,
        )
    )
    rate = args.request_rate
    serve = {
        "label": args.label,
        "server_label": server_label,
        "device": device,
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "dataset": {
            "name": args.dataset_name,
            "num_prompts": len(requests),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "range_ratio": args.range_ratio if args.dataset_name == "random" else 0.0,
            "seed": args.seed,
            "ignore_eos": args.ignore_eos,
            "structured_output": args.structured_output,
        },
        "request_rate": "inf" if rate == float("inf") else rate,
        "burstiness": args.burstiness,
        "max_concurrency": concurrency,
        # other work on the machine skews every latency: say how busy it was
        "host_load_avg_1m": {"start": load_before, "end": os.getloadavg()[0]},
    }
    return build_record(serve, request_rows(results), duration, env)


def warm_up(args, requests: list[BenchRequest], model: str) -> bool:
    """One request first, outside the measurement: connection set-up and any lazy server work. False (and a
    message) when it fails."""
    warm = asyncio.run(
        run_benchmark(
            args.base_url,
            args.endpoint,
            model,
            requests[:1],
            request_rate=float("inf"),
            burstiness=1.0,
            max_concurrency=1,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            api_key=args.api_key,
            timeout_s=args.timeout,
        )
    )[0][0]
    if not warm.success:
        print(f"bench serve: the warm-up request to {args.base_url} failed: {warm.error}", file=sys.stderr)
    return warm.success


def record_file_name(serve: dict) -> str:
    d = serve["dataset"]
    structured = d.get("structured_output", "none")
    return (f"{slug(serve['server_label'])}-{d['name']}-in{d['input_len']}-out{d['output_len']}-"
            f"{'' if structured == 'none' else structured + '-'}"
            f"c{serve['max_concurrency'] or 'inf'}-r{serve['request_rate']}.json")


def run_bench_serve(args) -> int:
    from kernel_lab.harness.env import device_label, environment_record

    if getattr(args, "llama_server", False):
        from .serve_pair import run_pair

        try:
            levels = _concurrency_levels(args.max_concurrency)
        except ValueError as exc:
            print(f"bench serve: {exc}", file=sys.stderr)
            return 2
        return run_pair(args, levels)
    if args.base_url is None:
        args.base_url = f"http://{args.host}:{args.port}"
    args.base_url = args.base_url.rstrip("/")
    try:
        levels = _concurrency_levels(args.max_concurrency)
        info = _discover_model(args.base_url, args.api_key)
    except ValueError as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001
        print(f"bench serve: cannot reach {args.base_url}/v1/models: {exc}", file=sys.stderr)
        return 1
    model = args.model or info["id"]
    server_label = args.server_label or info.get("owned_by") or "server"
    tokenizer = load_tokenizer(args.tokenizer)
    requests = build_workload(
        tokenizer,
        dataset=args.dataset_name,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        seed=args.seed,
    )
    env = environment_record()
    device = device_label(env) + " (server on the same machine)"
    if not warm_up(args, requests, model):
        return 1
    status = 0
    for concurrency in levels:
        record = benchmark_once(args, requests, model, server_label, concurrency, env, device)
        serve = record.record["serve"]
        print(format_summary(serve))
        if serve["metrics"]["failed"]:
            status = 1
        if args.result_dir:
            print(f"wrote {record.write_to(Path(args.result_dir) / record_file_name(serve))}")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernel-lab bench serve", description=__doc__.split("\n\n")[0])
    add_bench_serve_arguments(parser)
    return run_bench_serve(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["BenchRequest", "RequestResult", "build_record", "build_workload", "run_benchmark", "serve_block",
           "summarize"]
