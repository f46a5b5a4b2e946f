"""Project 09 benchmark: the assembled engine on random-weight models of real shapes.

    python projects/09_engine/benchmark.py [--quick] [--out DIR]

On CUDA, for the Qwen2.5-1.5B and Llama-3-8B shapes (bf16 weights generated on the GPU; no checkpoint):
1. Output tokens/s at concurrency 1 to 256: `concurrency` requests of 128 random prompt tokens and 128
   output tokens (greedy, EOS ignored) run to completion through the engine (continuous batching, CUDA
   graphs for decode steps). Timed from the first add_request to the last token.
2. The batch-1 decode step time against its floor: one decode step must read every weight once, so the
   floor is weight bytes / the device's measured copy bandwidth. Reported as GB/s and % of copy ceiling
   (target: the step within 1.5x of the floor, i.e. >= 67%).

On CPU it runs a tiny labelled sweep of a toy model so the script is exercised (functional only).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernel_lab.harness.bench import Timing, summarize  # noqa: E402
from kernel_lab.harness.results import ResultRecord  # noqa: E402

QWEN25_1_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
    "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128,
    "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "tie_word_embeddings": True, "eos_token_id": 151645, "torch_dtype": "bfloat16", "use_sliding_window": False,
}
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
    "tie_word_embeddings": False, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}
TOY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024,
    "tie_word_embeddings": True, "eos_token_id": 2,
}


def weight_bytes(engine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())


def run_workload(engine, concurrency: int, input_len: int, output_len: int, seed: int = 0) -> tuple[float, int]:
    from kernel_lab.engine import SamplingParams

    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    if engine.config.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(concurrency):
        engine.add_request(f"c{concurrency}-{i}", [rng.randrange(3, vocab) for _ in range(input_len)], params)
    generated = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated += len(out.outputs[0].new_token_ids)
    return time.perf_counter() - start, generated


def decode_step_timing(engine, context: int, steps: int) -> Timing:
    """Wall time of each engine step while one request decodes (scheduling and sampling included)."""
    from kernel_lab.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True, detokenize=False)
    engine.add_request("batch1", list(range(3, 3 + context)), params)
    engine.step()  # the prefill
    samples = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        samples.append((time.perf_counter() - t) * 1e3)
    return summarize(samples[2:] or samples, {"kind": "engine.step wall clock", "batch": 1, "context": context})


def bench_model(name: str, hf_config: dict, concurrencies, record: ResultRecord, device: torch.device,
                input_len: int, output_len: int) -> None:
    from kernel_lab.engine import LLMEngine

    max_model_len = input_len + output_len + 16
    engine = LLMEngine(hf_config, device=str(device), dtype="auto" if device.type == "cuda" else "float32",
                       max_model_len=max_model_len, max_num_seqs=max(concurrencies),
                       max_num_batched_tokens=max(8192, max(concurrencies)), enable_prefix_caching=False)
    dtype = str(engine.config.dtype).replace("torch.", "")
    wbytes = weight_bytes(engine)
    run_workload(engine, 2, 16, 4)  # warm-up: first prefill shapes, allocator
    for c in concurrencies:
        elapsed, generated = run_workload(engine, c, input_len, output_len)
        tok_s = generated / elapsed
        timing = Timing(elapsed * 1e3, elapsed * 1e3, elapsed * 1e3, elapsed * 1e3, 1,
                        {"kind": "whole workload wall clock", "requests": c})
        record.add_case(f"{name} output tok/s c={c}", shape={"concurrency": c, "input_len": input_len,
                                                              "output_len": output_len},
                        dtype=dtype, timing=timing,
                        extra={"metric": {"unit": "tok/s", "value": tok_s}, "percent_of_ceiling": None,
                               "ceiling": None})
        print(f"{name:24s} c={c:<4d} {tok_s:10.1f} output tok/s  ({generated} tokens in {elapsed:.2f} s)")
    step = decode_step_timing(engine, context=input_len, steps=64 if device.type == "cuda" else 8)
    case = record.add_case(f"{name} batch-1 decode step", shape={"batch": 1, "context": input_len,
                                                                 "weight_bytes": wbytes},
                           dtype=dtype, timing=step, nbytes=wbytes)
    floor_ms = wbytes / (record.ceilings["copy"]["GBps"] * 1e9) * 1e3
    print(f"{name:24s} batch-1 decode step {step.median_ms:.3f} ms; weight-read floor {floor_ms:.3f} ms "
          f"({step.median_ms / floor_ms:.2f}x the floor, {case['percent_of_ceiling']:.1f}% of copy bandwidth)")
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the subset run by tools/gpu_suite.sh")
    parser.add_argument("--out", default=None, help="write a result record under this directory")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "0")  # on CPU: the PyTorch reference path, not the interpreter
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record = ResultRecord("09_engine", "engine throughput and batch-1 decode", device,
                          description="random-weight models of real shapes; 128 prompt + 128 output tokens "
                                      "per request, greedy, EOS ignored")
    if device.type == "cuda":
        if args.quick:
            models = [("qwen2.5-1.5b-shape", QWEN25_1_5B, (1, 16, 64, 256))]
        else:
            models = [("qwen2.5-1.5b-shape", QWEN25_1_5B, (1, 2, 4, 8, 16, 32, 64, 128, 256)),
                      ("llama-3-8b-shape", LLAMA3_8B, (1, 4, 16, 64, 256))]
        for name, config, concurrencies in models:
            bench_model(name, config, concurrencies, record, device, input_len=128, output_len=128)
    else:
        print("CPU: a toy random model, functional only (not a measurement of the engine on a GPU)")
        torch.set_num_threads(1)  # a shared CPU: spinning OpenMP threads make a 2-core run erratic
        bench_model("toy-2-layer (CPU)", TOY, (1, 4), record, device, input_len=32, output_len=16)
    record.emit(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
