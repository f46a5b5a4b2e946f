"""`kernel-lab generate`, `kernel-lab demo` and `kernel-lab bench throughput` (routed from kernel_lab/cli.py).

    kernel-lab generate "What is the capital of France?"     stream a chat answer from the default model
    kernel-lab demo                                          several chats at once, continuous batching
    kernel-lab bench throughput --num-prompts 32 --input-len 128 --output-len 128 [--backend transformers|vllm]
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time


def seconds_since_process_start() -> float | None:
    """Wall time since this process started (Linux), so start-up cost includes Python and imports."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _add_engine_arguments(parser, max_num_seqs: int = 64, max_model_len: int = 2048) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--max-model-len", type=int, default=max_model_len)
    parser.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")


def _engine_kwargs(args) -> dict:
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                kv_cache_dtype=args.kv_cache_dtype, num_kv_blocks=args.num_kv_blocks,
                enable_prefix_caching=not args.no_prefix_caching, enforce_eager=args.enforce_eager)


def _add_sampling_arguments(parser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)


def _sampling_params(args, **overrides):
    from .sampling_params import SamplingParams

    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  seed=args.seed)
    kwargs.update(overrides)
    return SamplingParams(**kwargs)


# ------------------------------------------------------------------------------------------------ generate
def add_generate_arguments(parser) -> None:
    parser.add_argument("prompt", help="the user message (or raw text with --raw)")
    parser.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    parser.add_argument("--system", default=None, help="a system message for the chat template")
    _add_sampling_arguments(parser, max_tokens=256)
    _add_engine_arguments(parser, max_num_seqs=8)


def run_generate(args) -> int:
    from .llm import LLM

    llm = LLM(args.model, **_engine_kwargs(args))
    if args.raw:
        prompt = args.prompt
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": args.prompt}]
        prompt = llm.tokenizer.apply_chat_template(messages) if llm.tokenizer.chat_template_source else args.prompt
    params = _sampling_params(args)
    engine = llm.engine
    engine.add_request("generate", prompt, params)
    start = time.perf_counter()
    first_token_at = None
    num_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            completion = out.outputs[0]
            if first_token_at is None and completion.new_token_ids:
                first_token_at = time.perf_counter()
                since_start = seconds_since_process_start()
            num_tokens += len(completion.new_token_ids)
            if completion.new_text:
                sys.stdout.write(completion.new_text)
                sys.stdout.flush()
    end = time.perf_counter()
    sys.stdout.write("\n")
    decode_rate = (num_tokens - 1) / (end - first_token_at) if num_tokens > 1 and end > first_token_at else 0.0
    cold = f", {since_start:.2f} s after process start" if since_start is not None else ""
    print(f"[{num_tokens} tokens; first token {first_token_at - start:.2f} s after the request{cold}; "
          f"{decode_rate:.1f} tok/s after it; {engine.device.type}, {str(engine.dtype).replace('torch.', '')}]",
          file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------------ demo
DEMO_PROMPTS = [
    "Write a haiku about a GPU that dreams of electric sheep.",
    "What is the capital of France, and what is it famous for?",
    "Explain in two sentences why a KV cache speeds up text generation.",
    "Give me three tips for writing readable Python code.",
    "Tell me a very short story about a robot who learns to paint.",
    "What are the three primary colors?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Suggest a name for a friendly cat and explain why.",
]


def add_demo_arguments(parser) -> None:
    parser.add_argument("--num-prompts", type=int, default=len(DEMO_PROMPTS))
    _add_sampling_arguments(parser, max_tokens=160)
    _add_engine_arguments(parser, max_num_seqs=16)


class _Panel:
    """Live view of many streams: one line per request, redrawn in place on a terminal."""

    def __init__(self, prompts: list[str], stream):
        self.prompts, self.stream = prompts, stream
        self.texts = [""] * len(prompts)
        self.tokens = [0] * len(prompts)
        self.done = [False] * len(prompts)
        self.live = stream.isatty()
        self.drawn = 0
        self.last_draw = 0.0

    def update(self, index: int, new_text: str, new_tokens: int, finished: bool) -> None:
        self.texts[index] += new_text
        self.tokens[index] += new_tokens
        self.done[index] = finished

    def draw(self, status: str, force: bool = False) -> None:
        if not self.live or (not force and time.perf_counter() - self.last_draw < 0.1):
            return
        self.last_draw = time.perf_counter()
        width = shutil.get_terminal_size((100, 20)).columns
        lines = []
        for i, text in enumerate(self.texts):
            mark = "done" if self.done[i] else "...."
            flat = " ".join(text.split())
            head = f"[{i}] {mark} {self.tokens[i]:4d} tok | "
            room = max(10, width - len(head) - 1)
            lines.append(head + (flat[-room:] if len(flat) > room else flat))
        lines.append(status[:width - 1])
        out = f"\x1b[{self.drawn}F" if self.drawn else ""
        out += "".join(f"\x1b[2K{line}\n" for line in lines)
        self.stream.write(out)
        self.stream.flush()
        self.drawn = len(lines)


def run_demo(args) -> int:
    from .llm_engine import LLMEngine

    engine = LLMEngine(args.model, **_engine_kwargs(args))
    prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(args.num_prompts)]
    params = _sampling_params(args)
    panel = _Panel(prompts, sys.stdout)
    print(f"{engine.model_name} on {engine.device.type} ({str(engine.dtype).replace('torch.', '')}): "
          f"{len(prompts)} chats at once, continuous batching, max {engine.scheduler.max_num_seqs} in flight")
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]),
                           params)
    prompt_tokens = sum(len(engine.requests[str(i)].prompt_token_ids) for i in range(len(prompts)))
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            panel.update(int(out.request_id), c.new_text, len(c.new_token_ids), out.finished)
            if out.finished and not panel.live:
                print(f"\n[{out.request_id}] {prompts[int(out.request_id)]}\n{c.text.strip()}")
        steps += 1
        elapsed = time.perf_counter() - start
        generated = sum(panel.tokens)
        panel.draw(f"step {steps}: {len(engine.scheduler.running)} running, {len(engine.scheduler.waiting)} "
                   f"waiting, {generated} tokens, {generated / max(elapsed, 1e-9):.1f} tok/s")
    elapsed = time.perf_counter() - start
    panel.draw("", force=True)
    if panel.live:
        for i, prompt in enumerate(prompts):
            print(f"\n[{i}] {prompt}\n{panel.texts[i].strip()}")
    generated = sum(panel.tokens)
    stats = engine.stats()
    print(f"\n{len(prompts)} requests, {prompt_tokens} prompt + {generated} generated tokens in {elapsed:.1f} s: "
          f"{generated / elapsed:.1f} output tok/s, {(prompt_tokens + generated) / elapsed:.1f} total tok/s "
          f"({steps} steps, prefix-cache hits {stats['prefix_cache_hits']} tokens, "
          f"{stats['num_preemptions']} preemptions)")
    return 0


# ------------------------------------------------------------------------------------------------ bench
def add_bench_throughput_arguments(parser) -> None:
    parser.add_argument("--backend", default="kernel-lab", choices=["kernel-lab", "transformers", "vllm"],
                        help="vllm: vLLM's offline LLM, eager (needs vllm installed, e.g. project 08's .venv-vllm)")
    parser.add_argument("--dataset-name", default="random", choices=["random", "fixed"],
                        help="random: random token ids, lengths drawn within --range-ratio; fixed: exact lengths")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="random dataset: lengths uniform in [len*(1-r), len*(1+r)]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None, help="write the results as JSON to this file")
    _add_engine_arguments(parser, max_num_seqs=32, max_model_len=0)


def make_workload(num_prompts: int, input_len: int, output_len: int, dataset: str, range_ratio: float,
                  vocab_size: int, special_ids: set[int], seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request. Random ids avoid special tokens (an EOS or a chat
    marker in the prompt changes nothing for throughput, but keeps prompts ordinary text)."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in special_ids]

    def length(n):
        if dataset == "fixed" or range_ratio <= 0:
            return n
        return rng.randint(max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio))))

    return [([rng.choice(allowed) for _ in range(length(input_len))], length(output_len))
            for _ in range(num_prompts)]


def _bench_kernel_lab(args, workload) -> dict:
    from .llm_engine import LLMEngine
    from .sampling_params import SamplingParams

    engine = LLMEngine(args.model, **_engine_kwargs(args))
    # Warm-up outside the timing: first calls allocate and (on CUDA) compile.
    engine.add_request("warmup", workload[0][0][:8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.block_manager.reset_prefix_cache()
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(workload):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    generated = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated += len(out.outputs[0].new_token_ids)
    elapsed = time.perf_counter() - start
    return {"elapsed_time": elapsed, "generated": generated, "device": engine.device.type,
            "dtype": str(engine.dtype).replace("torch.", ""), "stats": engine.stats()}


def _bench_transformers(args, workload) -> dict:
    """Hugging Face `generate`, batched: the prompts in groups of --max-num-seqs, left-padded, greedy, EOS off."""
    import torch
    from transformers import AutoModelForCausalLM

    from kernel_lab.models.loader import resolve_model_dir

    from .llm_engine import resolve_device, resolve_dtype

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
            "dtype": str(dtype).replace("torch.", "")}


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
    from vllm import LLM as VllmLLM
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    from kernel_lab.models.loader import resolve_model_dir

    dtype = "float32" if args.dtype == "auto" else args.dtype
    llm = VllmLLM(model=str(resolve_model_dir(args.model)), dtype=dtype, enforce_eager=True,
                  max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                  kv_cache_memory_bytes=1 << 30, enable_prefix_caching=not args.no_prefix_caching,
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
            "device": current_platform.device_type, "dtype": dtype}


def run_bench_throughput(args) -> int:
    from kernel_lab.models.loader import load_config, resolve_model_dir
    from kernel_lab.models.tokenizer import Tokenizer

    model_dir = resolve_model_dir(args.model)
    tokenizer = Tokenizer.from_directory(model_dir)
    vocab = int(load_config(model_dir)["vocab_size"])
    workload = make_workload(args.num_prompts, args.input_len, args.output_len, args.dataset_name,
                             args.range_ratio, vocab, tokenizer.all_special_ids, args.seed)
    longest = max(len(p) + n for p, n in workload)
    if not args.max_model_len:
        args.max_model_len = longest
    if args.max_model_len < longest:
        raise SystemExit(f"--max-model-len {args.max_model_len} is shorter than the longest request ({longest})")
    runner = {"kernel-lab": _bench_kernel_lab, "transformers": _bench_transformers, "vllm": _bench_vllm}[args.backend]
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
        "device": result["device"], "dtype": result["dtype"], "seed": args.seed,
        "elapsed_time": elapsed, "num_requests": len(workload), "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens, "total_num_tokens": prompt_tokens + output_tokens,
        "requests_per_second": len(workload) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }
    if "stats" in result:
        summary["engine_stats"] = result["stats"]
    print(f"Throughput: {summary['requests_per_second']:.2f} requests/s, {summary['tokens_per_second']:.2f} "
          f"total tokens/s, {summary['output_tokens_per_second']:.2f} output tokens/s "
          f"({args.backend}, {len(workload)} prompts, concurrency {args.max_num_seqs}, {result['device']} "
          f"{result['dtype']}, {elapsed:.1f} s)")
    if args.output_json:
        from kernel_lab.harness.env import environment_record

        summary["env"] = environment_record()
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")
    return 0
