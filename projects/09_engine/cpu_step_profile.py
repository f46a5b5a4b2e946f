"""Where every millisecond of a CPU batch-1 decode step goes, by part (issue 32, item 2).

    python projects/09_engine/cpu_step_profile.py [--model FILE.gguf] [--threads 1 2] [--steps 50] [--out results]
    python projects/09_engine/cpu_step_profile.py --smoke      # bundled model, 3 steps, checks, no record

For each thread count it builds the engine (quantized GGUF weights, float32 activations) on the bundled
SmolLM2-135M or `--model` (e.g. the 1B Q4_K_M of make_1b_gguf.py), brings one sequence of `--input-len`
random prompt tokens into steady decode, then times `--steps` decode steps, alternating a plain step with a
profiled one (kernel_lab/engine/step_profile.py: exclusive wall-clock timers around the engine's real calls,
so the parts sum to the profiled step). Each part is reported as the median ms over the profiled steps and as
% of the median profiled step; the plain steps' median gives the timers' own cost. Pool wake-ups and the
barrier are inside the projection calls and count there.

Projection kernels against llama.cpp at the same shape: no built llama.cpp tool times one matmul
(`test-backend-ops` is not built; llama-bench and llama-batched-bench time whole models), so this script
does not compare them; cpu_step_floor.py times our projections alone.

Timings on a loaded machine are not records: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from kernel_lab.engine import SamplingParams  # noqa: E402
from kernel_lab.engine.llm_engine import LLMEngine  # noqa: E402
from kernel_lab.engine.step_profile import PARTS, StepProfile  # noqa: E402
from kernel_lab.harness.bench import summarize  # noqa: E402
from kernel_lab.harness.results import ResultRecord  # noqa: E402
from kernel_lab.ops import cpu_kernels  # noqa: E402
from kernel_lab.ops.gguf_linear import kernel_isa  # noqa: E402


def decoding_engine(model: str | None, input_len: int, steps: int, seed: int = 0) -> LLMEngine:
    """An engine with one sequence in steady decode, room for 2 * steps + 8 more tokens."""
    rng = random.Random(seed)
    engine = LLMEngine(model, dtype="float32", device="cpu", weights="quantized", max_num_seqs=1,
                       enable_prefix_caching=False, max_model_len=input_len + 2 * steps + 16)
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True)
    engine.add_request("0", [rng.randrange(1000, 20000) for _ in range(input_len)], params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    for _ in range(3):
        engine.step()
    return engine


def profile_steps(engine: LLMEngine, steps: int) -> tuple[list[float], list[dict[str, float]]]:
    """(plain step ms, profiled steps' parts), alternating plain and profiled steps."""
    plain, profiled = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        plain.append((time.perf_counter() - t0) * 1e3)
        with StepProfile(engine) as prof:
            t0 = time.perf_counter()
            engine.step()
            wall = (time.perf_counter() - t0) * 1e3
        parts = prof.steps[-1]
        parts["wall"] = wall
        profiled.append(parts)
    return plain, profiled


def split(profiled: list[dict[str, float]]) -> dict[str, float]:
    """Median ms of each part (and of the step) over the profiled steps."""
    return {p: statistics.median(s.get(p, 0.0) for s in profiled) for p in (*PARTS, "step", "wall")}


@contextmanager
def decode_stack_setting(value: str):
    """KERNEL_LAB_DECODE_STACK=value within the block (models/decode_stack.py reads it every forward)."""
    previous = os.environ.get("KERNEL_LAB_DECODE_STACK")
    os.environ["KERNEL_LAB_DECODE_STACK"] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("KERNEL_LAB_DECODE_STACK")
        else:
            os.environ["KERNEL_LAB_DECODE_STACK"] = previous


def smoke() -> int:
    torch.set_num_threads(1)
    for stack in ("0", "1"):   # the layers op by op, then as one C call (models/decode_stack.py)
        with decode_stack_setting(stack):
            engine = decoding_engine(None, input_len=16, steps=3)
            _, profiled = profile_steps(engine, 3)
        for parts in profiled:
            named = sum(v for k, v in parts.items() if k not in ("step", "wall"))
            assert abs(named - parts["step"]) < 1e-9, parts
            assert abs(parts["step"] - parts["wall"]) <= 0.1 * parts["wall"], parts
            inner = ("decoder layers (C)",) if stack == "1" else ("projections (C)", "attention (+rope+kv write) (C)")
            assert all(parts.get(p, 0) > 0 for p in (*inner, "lm_head (C)")), parts
        print(f"smoke, KERNEL_LAB_DECODE_STACK={stack}: parts sum to within 10% of the step:",
              ", ".join(f"{p['step']:.2f}/{p['wall']:.2f} ms" for p in profiled))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1 and all cores")
    parser.add_argument("--decode-stack", nargs="+", default=["0", "1"], choices=["0", "1"],
                        help="KERNEL_LAB_DECODE_STACK settings to profile: 0 splits the layers op by op, 1 runs "
                             "them as one C call (the default engine); default both")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50, help="profiled steps (as many plain ones alternate)")
    parser.add_argument("--out", default=str(REPO / "results"))
    parser.add_argument("--smoke", action="store_true", help="3 steps on the bundled model, check, no record")
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke()
    cores = os.cpu_count() or 1
    threads_list = args.threads or sorted({1, min(2, cores), cores})
    label = ("bundled SmolLM2-135M-Instruct" if args.model is None
             else f"{Path(args.model).parent.name} {Path(args.model).stem}")   # e.g. random-llama-1b-v1 Q4_K_M
    record = ResultRecord(
        "09_engine", "CPU batch-1 decode step profile" + ("" if args.model is None else f" on {label}"), "cpu",
        description=f"{label}, quantized GGUF weights (gguf_linear, ISA {kernel_isa()}, "
                    f"KERNEL_LAB_CPU_ISA={cpu_kernels.isa()}), float32 activations, batch 1: every part of "
                    "LLMEngine.step() by exclusive wall-clock timers around the engine's real calls and C "
                    "calls (kernel_lab/engine/step_profile.py), median ms per part over the profiled steps, "
                    "alternating with plain steps (their median is the case's timing); pool wake-ups count "
                    "in the projections' C time. decode stack 0: the layers op by op (the split); 1: the "
                    "layers as one C call (models/decode_stack.py, the engine's default). The CPU model and "
                    "ISA flags are in env.",
        ceilings_record={})
    headline = []
    for threads in threads_list:
        for stack in args.decode_stack:
            torch.set_num_threads(threads)
            with decode_stack_setting(stack):
                engine = decoding_engine(args.model, args.input_len, args.steps)
                plain, profiled = profile_steps(engine, args.steps)
            parts = split(profiled)
            step = parts["step"]
            shares = {p: {"ms": parts[p], "percent": 100 * parts[p] / step} for p in PARTS}
            timing = summarize(plain, {"timer": "time.perf_counter (CPU wall clock)", "device": "cpu",
                                       "what": "LLMEngine.step() at batch 1, unprofiled, alternating with profiled"})
            name = f"decode step, batch 1, {threads} thread{'s' if threads > 1 else ''}, decode stack {stack}"
            record.add_case(name, shape={"batch": 1, "threads": threads, "input_len": args.input_len,
                                         "decode_stack": int(stack)}, dtype="float32", timing=timing,
                            extra={"parts": shares, "profiled_step_ms": step, "profiled_wall_ms": parts["wall"],
                                   "timer_overhead_ms": step - timing.median_ms})
            print(f"{threads} thread(s), decode stack {stack}: plain step {timing.median_ms:.2f} ms, "
                  f"profiled {step:.2f} ms")
            for p in PARTS:
                if parts[p] > 0:
                    print(f"  {p:32s} {parts[p]:7.3f} ms  {100 * parts[p] / step:5.1f}%")
            top = sorted(PARTS, key=lambda p: -parts[p])[:3]
            headline.append(f"{threads} thread(s), stack {stack}: "
                            + ", ".join(f"{p} {100 * parts[p] / step:.0f}%" for p in top))
            del engine
    record.set_headline("; ".join(headline))
    record.emit(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
