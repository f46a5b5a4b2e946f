"""`kernel-lab generate` and `kernel-lab demo`: the engine streaming text to a terminal.

    kernel-lab generate "What is the capital of France?"     stream a chat answer from the default model
    kernel-lab demo                                          several chats at once, continuous batching
"""

from __future__ import annotations

import os
import shutil
import sys
import time

from kernel_lab.cli import add_sampling_arguments, describe_sampling, sampling_params
from kernel_lab.engine.arg_utils import add_engine_arguments, engine_kwargs


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


def add_generate_arguments(parser) -> None:
    parser.add_argument("prompt", help="the user message (or raw text with --raw)")
    parser.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    parser.add_argument("--system", default=None, help="a system message for the chat template")
    add_sampling_arguments(parser, max_tokens=256)
    add_engine_arguments(parser, exclude=("seed",), max_num_seqs=8)  # --seed: the request's


def run_generate(args) -> int:
    from kernel_lab.engine import LLM

    llm = LLM(**engine_kwargs(args))
    if args.raw:
        prompt = args.prompt
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": args.prompt}]
        prompt = llm.tokenizer.apply_chat_template(messages) if llm.tokenizer.chat_template_source else args.prompt
    params = sampling_params(args, llm.engine.config.sampling_defaults)
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
          f"{decode_rate:.1f} tok/s after it; {engine.config.device.type}, "
          f"{str(engine.config.dtype).replace('torch.', '')}]",
          file=sys.stderr)
    return 0


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
    add_sampling_arguments(parser, max_tokens=160)
    add_engine_arguments(parser, exclude=("seed",), max_num_seqs=16)


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
    from kernel_lab.engine import LLMEngine

    engine = LLMEngine(**engine_kwargs(args))
    prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(args.num_prompts)]
    params = sampling_params(args, engine.config.sampling_defaults)
    panel = _Panel(prompts, sys.stdout)
    config = engine.config
    print(f"{config.model_name} on {config.device.type} ({str(config.dtype).replace('torch.', '')}): "
          f"{len(prompts)} chats at once, continuous batching, max {engine.scheduler.max_num_seqs} in flight\n"
          f"sampling: {describe_sampling(params)} (--greedy for greedy decoding)")
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
