"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand: a few
counters, gauges and histograms do not need a client library.

Everything is recorded on the engine thread (where the timings are observed) and rendered on the event
loop thread (GET /metrics), so one lock guards the state. Names carry the `kernel_lab_` prefix; the set
mirrors what vLLM exports (running/waiting, KV usage, prefix-cache hit rate, TTFT, inter-token latency,
end-to-end latency, token counters) so the same dashboards apply.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque

from kernel_lab.engine.interface import EngineStats

PREFIX = "kernel_lab_"

# Bucket upper bounds in seconds; CPU serving is slow, so they reach further than a GPU server's would.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0)
THROUGHPUT_WINDOW_S = 10.0


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # last slot: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


NO_ENGINE_YET = EngineStats(num_running=0, num_waiting=0, kv_cache_blocks_total=0, kv_cache_blocks_free=0,
                            prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, num_generated_tokens=0)


class ServerMetrics:
    """Counters, gauges and histograms for one server. Call the `on_*` methods from the engine thread."""

    def __init__(self, model_name: str = ""):
        self.lock = threading.Lock()
        self.model_name = model_name
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.finished_prompt_tokens = 0
        self.finished_generation_tokens = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.rejected: dict[str, int] = {}
        self.engine_stats: EngineStats | None = None  # the latest, from the engine thread
        self.engine_steps = 0
        self._recent: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, generated tokens)

    # ------------------------------------------------------------------ recording (engine thread)
    def on_first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        with self.lock:
            self.ttft.observe(ttft_s)
            self.prompt_tokens_total += prompt_tokens
            self._record_recent(prompt_tokens, 0)

    def on_tokens(self, new_tokens: int, gap_s: float | None) -> None:
        """`new_tokens` tokens arrived for one sequence, `gap_s` after its previous ones (None for the
        first), so each token's inter-token latency is gap / new_tokens."""
        if new_tokens <= 0:
            return
        with self.lock:
            self.generation_tokens_total += new_tokens
            if gap_s is not None:
                self.itl.observe(gap_s / new_tokens, new_tokens)
            self._record_recent(0, new_tokens)

    def on_finished(self, reason: str, e2e_s: float, prompt_tokens: int, generated_tokens: int) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if reason != "abort":
                self.e2e.observe(e2e_s)
                self.finished_prompt_tokens += prompt_tokens
                self.finished_generation_tokens += generated_tokens

    def on_rejected(self, reason: str) -> None:
        with self.lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def on_step(self, engine_stats: EngineStats) -> None:
        with self.lock:
            self.engine_stats = engine_stats
            self.engine_steps += 1

    def _record_recent(self, prompt_tokens: int, generated_tokens: int) -> None:
        """Append to the throughput window and trim it here (under the lock), so it holds THROUGHPUT_WINDOW_S
        seconds of events whether or not anyone reads /metrics."""
        now = time.monotonic()
        self._recent.append((now, prompt_tokens, generated_tokens))
        self._trim_recent(now)

    def _trim_recent(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    # ------------------------------------------------------------------ reading
    def throughput(self) -> tuple[float, float]:
        """(prompt tokens/s, generation tokens/s) over the last THROUGHPUT_WINDOW_S seconds."""
        with self.lock:
            self._trim_recent(time.monotonic())
            prompt = sum(p for _, p, _ in self._recent)
            gen = sum(g for _, _, g in self._recent)
        return prompt / THROUGHPUT_WINDOW_S, gen / THROUGHPUT_WINDOW_S

    def snapshot(self) -> dict:
        prompt_tps, gen_tps = self.throughput()
        with self.lock:
            stats = self.engine_stats or NO_ENGINE_YET
            total, free = stats["kv_cache_blocks_total"], stats["kv_cache_blocks_free"]
            queries, hits = stats["prefix_cache_queries"], stats["prefix_cache_hits"]
            return {
                "num_requests_running": stats["num_running"],
                "num_requests_waiting": stats["num_waiting"],
                "kv_cache_blocks_total": total,
                "kv_cache_blocks_free": free,
                "kv_cache_usage_perc": (1.0 - free / total) if total else 0.0,
                "prefix_cache_queries": queries,
                "prefix_cache_hits": hits,
                "prefix_cache_hit_rate": hits / queries if queries else 0.0,
                "num_preemptions": stats["num_preemptions"],
                "request_success": dict(self.finished),
                "finished_prompt_tokens": self.finished_prompt_tokens,
                "finished_generation_tokens": self.finished_generation_tokens,
                "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total,
                "rejected": dict(self.rejected),
                "prompt_throughput_toks_per_s": prompt_tps,
                "generation_throughput_toks_per_s": gen_tps,
                "ttft_count": self.ttft.count,
                "e2e_count": self.e2e.count,
                "itl_count": self.itl.count,
                "spec_decode": stats.get("spec_decode"),
                "lora_requests": stats.get("lora_requests"),
            }

    def render(self, extra_gauges: dict[str, tuple[str, float]] | None = None) -> str:
        snap = self.snapshot()
        model = {"model_name": self.model_name}
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[tuple[str, dict, float]]) -> None:
            lines.append(f"# HELP {PREFIX}{name} {help_text}")
            lines.append(f"# TYPE {PREFIX}{name} {kind}")
            for suffix, labels, value in samples:
                lines.append(f"{PREFIX}{name}{suffix}{_labels(labels)} {_fmt(value)}")

        def gauge(name: str, help_text: str, value: float) -> None:
            family(name, "gauge", help_text, [("", model, value)])

        def counter(name: str, help_text: str, value: float, labels: dict | None = None) -> None:
            family(name, "counter", help_text, [("_total", model | (labels or {}), value)])

        gauge("num_requests_running", "Requests in the engine's running batch.", snap["num_requests_running"])
        gauge("num_requests_waiting", "Requests waiting to be scheduled.", snap["num_requests_waiting"])
        gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", snap["kv_cache_usage_perc"])
        gauge("kv_cache_blocks_total", "KV-cache blocks in the pool.", snap["kv_cache_blocks_total"])
        gauge("kv_cache_blocks_free", "KV-cache blocks free.", snap["kv_cache_blocks_free"])
        gauge(
            "prefix_cache_hit_rate",
            "Prefix-cache hits / queries since start (tokens).",
            snap["prefix_cache_hit_rate"],
        )
        counter("prefix_cache_queries", "Prefix-cache queries (tokens).", snap["prefix_cache_queries"])
        counter("prefix_cache_hits", "Prefix-cache hits (tokens).", snap["prefix_cache_hits"])
        counter("num_preemptions", "Sequences preempted by the scheduler.", snap["num_preemptions"])
        family(
            "request_success",
            "counter",
            "Requests finished, by finish reason (abort: client gone).",
            [("_total", model | {"finished_reason": r}, v) for r, v in sorted(snap["request_success"].items())],
        )
        family(
            "request_rejected",
            "counter",
            "Requests refused before reaching the engine, by reason.",
            [("_total", model | {"reason": r}, v) for r, v in sorted(snap["rejected"].items())],
        )
        counter(
            "prompt_tokens",
            "Prompt tokens of requests that reached their first token.",
            snap["prompt_tokens_total"],
        )
        counter(
            "generation_tokens",
            "Tokens generated (aborted requests included).",
            snap["generation_tokens_total"],
        )
        counter(
            "request_prompt_tokens",
            "Prompt tokens of requests that finished (not aborted).",
            snap["finished_prompt_tokens"],
        )
        counter(
            "request_generation_tokens",
            "Generated tokens of requests that finished (not aborted).",
            snap["finished_generation_tokens"],
        )
        gauge(
            "avg_prompt_throughput_toks_per_s",
            f"Prompt tokens/s over the last {THROUGHPUT_WINDOW_S:g} s.",
            snap["prompt_throughput_toks_per_s"],
        )
        gauge(
            "avg_generation_throughput_toks_per_s",
            f"Generated tokens/s over the last {THROUGHPUT_WINDOW_S:g} s.",
            snap["generation_throughput_toks_per_s"],
        )
        spec = snap["spec_decode"]
        if spec is not None:    # vLLM's names, present only with speculative decoding on
            counter("spec_decode_num_drafts", "Draft proposals verified (one per sequence and step).",
                    spec["num_drafts"])
            counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", spec["num_draft_tokens"])
            counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec["num_accepted_tokens"])
            family("spec_decode_num_accepted_tokens_per_pos", "counter",
                   "Draft tokens accepted, by position in the draft (0: the first).",
                   [("_total", model | {"position": str(i)}, v)
                    for i, v in enumerate(spec["num_accepted_tokens_per_pos"])])
        lora = snap["lora_requests"]
        if lora is not None:    # with --enable-lora: vLLM's info gauge (its value: the time of the reading)
            family("lora_requests_info", "gauge", "Adapters of the running and the waiting requests.",
                   [("", model | {"running_lora_adapters": ",".join(sorted(lora["running"])),
                                  "waiting_lora_adapters": ",".join(sorted(lora["waiting"])),
                                  "max_lora": str(lora["max_lora"])}, time.time())])
            for state in ("running", "waiting"):
                family(f"lora_requests_{state}", "gauge", f"Requests {state}, by adapter.",
                       [("", model | {"lora_name": name}, n) for name, n in sorted(lora[state].items())])
        for name, (help_text, value) in (extra_gauges or {}).items():
            gauge(name, help_text, value)
        with self.lock:
            for name, hist, help_text in (
                ("time_to_first_token_seconds", self.ttft, "Time from arrival to the first generated token."),
                ("inter_token_latency_seconds", self.itl, "Time between consecutive generated tokens."),
                ("e2e_request_latency_seconds", self.e2e, "Time from arrival to the last token (finished)."),
            ):
                samples, running = [], 0
                for bound, count in zip(hist.bounds, hist.counts, strict=False):
                    running += count
                    samples.append(("_bucket", model | {"le": _fmt(float(bound))}, running))
                samples.append(("_bucket", model | {"le": "+Inf"}, hist.count))
                samples.append(("_sum", model, hist.sum))
                samples.append(("_count", model, hist.count))
                family(name, "histogram", help_text, samples)
        return "\n".join(lines) + "\n"
