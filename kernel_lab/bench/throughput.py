"""`kernel-lab bench throughput`: offline throughput of this engine, Hugging Face transformers, vLLM or llama.cpp on
the same token-id workload, modelled on `vllm bench throughput`.

    kernel-lab bench throughput --num-prompts 32 --input-len 128 --output-len 128 \
        [--backend transformers|vllm|llama.cpp] [--threads N]

llama.cpp runs in a subprocess with the Python of its own environment (`--llama-cpp-python`, default
.venv-llamacpp, built by `make llama-cpp-env`) on the GGUF file itself (the bundled one by default), through
the continuous-batching loop of kernel_lab/bench/llama_cpp.py.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kernel_lab.engine.arg_utils import add_engine_arguments, engine_kwargs

from .workload import add_workload_arguments, draw_length, load_tokenizer

REPO = Path(__file__).resolve().parents[2]
DEFAULT_LLAMA_CPP_PYTHON = REPO / ".venv-llamacpp" / "bin" / "python"
BACKENDS = ["kernel-lab", "transformers", "vllm", "llama.cpp"]


def add_bench_throughput_arguments(parser) -> None:
    parser.add_argument("--backend", default="kernel-lab", choices=BACKENDS,
                        help="vllm: vLLM's offline LLM, eager (needs vllm installed, e.g. project 08's .venv-vllm); "
                             "llama.cpp: llama-cpp-python's C API with continuous batching, in --llama-cpp-python")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads: torch's intra-op threads (kernel-lab, transformers), n_threads and "
                             "n_threads_batch (llama.cpp), the bound cores 0..N-1 (vllm, unless "
                             "VLLM_CPU_OMP_THREADS_BIND is set). Default: torch's default; all cores for llama.cpp")
    parser.add_argument("--llama-cpp-python", default=str(DEFAULT_LLAMA_CPP_PYTHON),
                        help="a Python with llama_cpp and numpy (default: .venv-llamacpp, `make llama-cpp-env`)")
    add_workload_arguments(parser, num_prompts=32, input_len=128, output_len=128)
    parser.add_argument("--output-json", default=None, help="write the results as JSON to this file")
    add_engine_arguments(parser, max_num_seqs=32, max_model_len=0)  # 0: the workload's longest; --seed seeds both


def make_workload(num_prompts: int, input_len: int, output_len: int, dataset: str, range_ratio: float,
                  vocab_size: int, special_ids: set[int], seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request. Random ids avoid special tokens (an EOS or a chat
    marker in the prompt changes nothing for throughput, but keeps prompts ordinary text)."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in special_ids]
    ratio = range_ratio if dataset == "random" else 0.0
    return [([rng.choice(allowed) for _ in range(draw_length(rng, input_len, ratio))],
             draw_length(rng, output_len, ratio)) for _ in range(num_prompts)]


def _bench_kernel_lab(args, workload) -> dict:
    from kernel_lab.engine import LLMEngine, SamplingParams

    _set_torch_threads(args)
    engine = LLMEngine(**engine_kwargs(args))
    # Warm-up outside the timing: first calls allocate and (on CUDA) compile.
    engine.add_request("warmup", workload[0][0][:8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.block_manager.reset_prefix_cache()
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(workload):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    generated = 0
    tokens_so_far: dict[str, int] = {}
    decode_step_seconds = []  # steps whose every token follows an earlier one: no prompt's first token
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        step_seconds = time.perf_counter() - step_start
        first_token = False
        for out in outputs:
            new = len(out.outputs[0].new_token_ids)
            first_token |= tokens_so_far.get(out.request_id, 0) == 0
            tokens_so_far[out.request_id] = tokens_so_far.get(out.request_id, 0) + new
            generated += new
        if outputs and not first_token:
            decode_step_seconds.append(step_seconds)
    elapsed = time.perf_counter() - start
    import torch

    result = {"elapsed_time": elapsed, "generated": generated, "device": engine.config.device.type,
              "dtype": str(engine.config.dtype).replace("torch.", ""),
              "kv_cache_dtype": str(engine.config.kv_cache_dtype).replace("torch.", ""), "stats": engine.stats(),
              "threads": torch.get_num_threads(), "decode_step_seconds": decode_step_seconds}
    if engine.config.device.type == "cpu":
        from kernel_lab.ops import cpu_kernels, gguf_linear

        # which build the C kernels ran (KERNEL_LAB_CPU_ISA) and the path gguf_linear's build took in it
        result["cpu_kernels"] = {"isa": cpu_kernels.isa(), "gguf_linear_path": gguf_linear.kernel_isa()}
    return result


def _set_torch_threads(args) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)


def _bench_transformers(args, workload) -> dict:
    """Hugging Face `generate`, batched: the prompts in groups of --max-num-seqs, left-padded, greedy, EOS off."""
    import torch
    from transformers import AutoModelForCausalLM

    from kernel_lab.engine.config import resolve_device, resolve_dtype
    from kernel_lab.models.loader import resolve_model_dir

    _set_torch_threads(args)
    model_dir = resolve_model_dir(args.model)
    device = resolve_device(args.device)
    dtype = torch.float32 if args.dtype == "auto" and device.type == "cpu" else resolve_dtype(args.dtype, device, {})
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # ignore EOS: every request makes its full output length
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def run(batch):
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
        new = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                           pad_token_id=pad)
        # A static batch runs until its longest request ends; only requested tokens count as output.
        return sum(n for _, n in batch)

    run([(workload[0][0][:8], 4)])  # warm-up
    start = time.perf_counter()
    generated = 0
    for i in range(0, len(workload), args.max_num_seqs):
        generated += run(workload[i:i + args.max_num_seqs])
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {"elapsed_time": elapsed, "generated": generated, "device": device.type,
            "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads()}


def vllm_cpu_env(cores: str | None = None) -> dict[str, str]:
    """Environment for a vLLM CPU run that this lab times: engine and worker in one process, no core held
    back, no usage reporting (no network), and its OpenMP threads bound to `cores` (e.g. "0" or "0-1")."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_NO_USAGE_STATS": "1"}
    if cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    return env


def _bench_vllm(args, workload) -> dict:
    """vLLM's offline `LLM.generate` on the same token-id prompts, eager mode (on CPU: vllm-cpu). vLLM
    reads its CPU thread binding from the environment (VLLM_CPU_OMP_THREADS_BIND)."""
    if args.threads and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    from vllm import LLM as VllmLLM
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    from kernel_lab.models.loader import resolve_model_dir

    dtype = "float32" if args.dtype == "auto" else args.dtype
    llm = VllmLLM(model=str(resolve_model_dir(args.model)), dtype=dtype, enforce_eager=True,
                  max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                  kv_cache_memory_bytes=1 << 30, enable_prefix_caching=args.enable_prefix_caching,
                  seed=args.seed)

    def params(n):
        return VllmSamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    llm.generate([TokensPrompt(prompt_token_ids=workload[0][0][:8])], params(4), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in workload], [params(n) for _, n in workload],
                           use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"elapsed_time": elapsed, "generated": sum(len(o.outputs[0].token_ids) for o in outputs),
            "device": current_platform.device_type, "dtype": dtype, "threads": args.threads}


def gguf_path(model) -> Path:
    """The GGUF file llama.cpp runs: `model` when it is one, else the bundled SmolLM2-135M-Instruct."""
    from kernel_lab.models.gguf import default_model_path

    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_file() and (path.suffix.lower() == ".gguf" or path.read_bytes()[:4] == b"GGUF"):
        return path
    raise SystemExit(f"--backend llama.cpp needs a GGUF file; {str(model)!r} is not one")


def run_llama_cpp(python: Path, spec: dict) -> dict:
    """Run kernel_lab/bench/llama_cpp.py on `spec` with the llama.cpp environment's Python; its output JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.json", Path(tmp) / "out.json"
        src.write_text(json.dumps(spec))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        subprocess.run([str(python), "-m", "kernel_lab.bench.llama_cpp", str(src), str(dst)], check=True, env=env,
                       stdout=sys.stderr)
        return json.loads(dst.read_text())


def _bench_llama_cpp(args, workload) -> dict:
    """llama.cpp on the GGUF's own weights, in a subprocess with the llama.cpp environment's Python
    (kernel_lab/bench/llama_cpp.py: continuous batching over max_num_seqs sequences, greedy, EOS ignored)."""
    python = Path(args.llama_cpp_python)
    if not python.exists():
        raise SystemExit(f"no llama.cpp Python at {python}: build it with `make llama-cpp-env` "
                         "(projects/09_engine/llama_cpp_env.sh) or pass --llama-cpp-python")
    model = gguf_path(args.model)
    threads = args.threads or os.cpu_count() or 1
    spec = {"model": str(model), "prompts": [p for p, _ in workload], "output_len": [n for _, n in workload],
            "concurrency": args.max_num_seqs, "threads": threads}
    out = run_llama_cpp(python, spec)
    if [len(o) for o in out["outputs"]] != [n for _, n in workload]:
        raise SystemExit("llama.cpp did not generate exactly the requested number of tokens per request")
    return {"elapsed_time": out["elapsed_time"], "generated": out["generated"], "device": "cpu",
            "dtype": "gguf weights as stored (8-bit activations in quantized dot products, f16 KV cache)",
            "threads": threads, "decode_step_seconds": out["decode_step_seconds"],
            "llama_cpp": {"version": out["llama_cpp_python"], "system_info": out["system_info"],
                          "gguf": str(model), "python": str(python), "n_batch": out["n_batch"],
                          "kv_unified": out["kv_unified"]}}


def decode_step_summary(seconds: list[float]) -> dict:
    """Decode-only steps' wall times (ms: median, p20, p80, min, count). At concurrency 1 every such step
    makes one token, so 1000 / median_ms is the batch-1 decode rate, prompt processing excluded."""
    from kernel_lab.harness.bench import summarize

    return summarize([t * 1e3 for t in seconds], {"kind": "wall clock of each decode-only step"}).to_dict()


def run_bench_throughput(args) -> int:
    from kernel_lab.models.loader import load_config, resolve_model_dir

    # The workload needs only the tokenizer and config: a GGUF's float32 export (4 bytes a parameter) is made
    # only by the baselines that read it (transformers, vLLM).
    model_dir = resolve_model_dir(args.model, float_weights=False)
    tokenizer = load_tokenizer(model_dir)
    vocab = int(load_config(model_dir)["vocab_size"])
    workload = make_workload(args.num_prompts, args.input_len, args.output_len, args.dataset_name,
                             args.range_ratio, vocab, tokenizer.all_special_ids, args.seed)
    longest = max(len(p) + n for p, n in workload)
    if not args.max_model_len:
        args.max_model_len = longest
    if args.max_model_len < longest:
        raise SystemExit(f"--max-model-len {args.max_model_len} is shorter than the longest request ({longest})")
    runner = {"kernel-lab": _bench_kernel_lab, "transformers": _bench_transformers, "vllm": _bench_vllm,
              "llama.cpp": _bench_llama_cpp}[args.backend]
    result = runner(args, workload)
    elapsed = result["elapsed_time"]
    prompt_tokens = sum(len(p) for p, _ in workload)
    output_tokens = sum(n for _, n in workload)
    if result["generated"] != output_tokens:  # EOS is ignored, so every request must make its full length
        raise SystemExit(f"{args.backend} generated {result['generated']} tokens; the workload asks for "
                         f"{output_tokens}")
    summary = {
        "backend": args.backend,
        "model": args.model or "SmolLM2-135M-Instruct (bundled)",
        "dataset": args.dataset_name, "num_prompts": len(workload), "input_len": args.input_len,
        "output_len": args.output_len, "range_ratio": args.range_ratio, "concurrency": args.max_num_seqs,
        "device": result["device"], "dtype": result["dtype"], "kv_cache_dtype": result.get("kv_cache_dtype"),
        "threads": result.get("threads"), "seed": args.seed,
        "elapsed_time": elapsed, "num_requests": len(workload), "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens, "total_num_tokens": prompt_tokens + output_tokens,
        "requests_per_second": len(workload) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }
    if result.get("decode_step_seconds"):
        summary["decode_steps"] = decode_step_summary(result["decode_step_seconds"])
    if "stats" in result:
        summary["engine_stats"] = result["stats"]
        if "spec_decode" in result["stats"]:
            from kernel_lab.engine.speculative import acceptance_summary

            summary["spec_decode"] = acceptance_summary(result["stats"]["spec_decode"])
    if "llama_cpp" in result:
        summary["llama_cpp"] = result["llama_cpp"]
    if "cpu_kernels" in result:
        summary["cpu_kernels"] = result["cpu_kernels"]
    print(f"Throughput: {summary['requests_per_second']:.2f} requests/s, {summary['tokens_per_second']:.2f} "
          f"total tokens/s, {summary['output_tokens_per_second']:.2f} output tokens/s "
          f"({args.backend}, {len(workload)} prompts, concurrency {args.max_num_seqs}, {result['device']} "
          f"{result['dtype']}, {result.get('threads')} thread(s), {elapsed:.1f} s)")
    if "spec_decode" in summary:
        spec = summary["spec_decode"]
        print(f"Speculative decoding: acceptance rate {spec['acceptance_rate']}, mean acceptance length "
              f"{spec['mean_acceptance_length']}, per position {spec['acceptance_per_position']}")
    if args.output_json:
        from kernel_lab.harness.env import environment_record

        summary["env"] = environment_record()
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")
    return 0
