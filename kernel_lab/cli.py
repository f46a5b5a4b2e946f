"""`kernel-lab` command line. Each subcommand lives in the module that owns its job; this file routes,
imports lazily so `kernel-lab env` stays fast, and holds the sampling flags several commands share (the engine's
flags come from EngineConfig: kernel_lab.engine.arg_utils).

    kernel-lab generate "prompt"      stream text from the default model         (kernel_lab.chat)
    kernel-lab demo                   several chats at once, continuous batching (kernel_lab.chat)
    kernel-lab serve                  OpenAI-compatible server                   (kernel_lab.server.launch)
    kernel-lab bench throughput       offline throughput, like `vllm bench throughput` (kernel_lab.bench.throughput)
    kernel-lab bench serve            online serving benchmark, like `vllm bench serve` (kernel_lab.bench.serve)
    kernel-lab env                    print the environment record
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

# subcommand -> (module, help). A module provides add_<name>_arguments(parser) and run_<name>(args) -> int.
COMMANDS = {
    "generate": ("kernel_lab.chat", "stream a completion from the default (or given) model"),
    "demo": ("kernel_lab.chat", "run several chat prompts at once and stream them"),
    "serve": ("kernel_lab.server.launch", "start the OpenAI-compatible server"),
}
BENCH_COMMANDS = {
    "throughput": ("kernel_lab.bench.throughput", "offline throughput benchmark"),
    "serve": ("kernel_lab.bench.serve", "online serving benchmark against any OpenAI-compatible server"),
}


def _attach(sub, name: str, module: str, help_text: str, prefix: str = "") -> None:
    parser = sub.add_parser(name, help=help_text)
    func = f"{prefix}{name}".replace("-", "_")
    try:
        mod = importlib.import_module(module)
        getattr(mod, f"add_{func}_arguments")(parser)
        parser.set_defaults(_run=getattr(mod, f"run_{func}"))
    except (ImportError, AttributeError) as exc:
        parser.set_defaults(_run=lambda args, exc=exc: _unavailable(name, exc))


def _unavailable(name: str, exc: Exception) -> int:
    print(f"kernel-lab {name} is unavailable: {exc}", file=sys.stderr)
    return 2


def _run_env(args) -> int:
    from kernel_lab.harness.env import environment_record

    print(json.dumps(environment_record(), indent=1))
    return 0


# `generate` and `demo` sample with these where neither a flag nor the model's generation_config.json
# (--generation-config auto) says otherwise. Greedy decoding of the bundled SmolLM2-135M-Instruct loops on
# some chats (one of the demo's eight repeats "Echo was tasked with creating a new art piece" until
# --max-tokens); mild sampling with a repetition penalty does not, on any of the eight, and the fixed seed
# makes the output the same on every run. --greedy (or --temperature 0) is plain greedy decoding.
CLI_SAMPLING_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "repetition_penalty": 1.1}
CLI_SEED = 0
_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "repetition_penalty")


def add_sampling_arguments(parser, max_tokens: int) -> None:
    d = CLI_SAMPLING_DEFAULTS
    model = " unless the model's generation_config.json sets it"
    parser.add_argument("--max-tokens", type=int, default=None, help=f"default: {max_tokens}{model}")
    parser.add_argument("--temperature", type=float, default=None,
                        help=f"0 = greedy; default: {d['temperature']}{model}")
    parser.add_argument("--top-p", type=float, default=None, help=f"default: {d['top_p']}{model}")
    parser.add_argument("--top-k", type=int, default=None, help=f"0 = off; default: {d['top_k']}{model}")
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help=f"1 = off; default: {d['repetition_penalty']}{model}")
    parser.add_argument("--seed", type=int, default=CLI_SEED, help=f"the request's seed (default: {CLI_SEED})")
    parser.add_argument("--greedy", action="store_true",
                        help="plain greedy decoding (temperature 0, no repetition penalty); flags given still win")
    parser.set_defaults(_default_max_tokens=max_tokens)


def sampling_params(args, model_defaults: dict | None = None, **overrides):
    """The command's SamplingParams: a flag given, else --greedy, else the model's generation_config.json
    values (EngineConfig.sampling_defaults), else CLI_SAMPLING_DEFAULTS."""
    from kernel_lab.engine import SamplingParams

    kwargs = {**CLI_SAMPLING_DEFAULTS, "max_tokens": args._default_max_tokens, **(model_defaults or {})}
    if args.greedy:
        kwargs.update(temperature=0.0, repetition_penalty=1.0)
    kwargs.update({name: getattr(args, name) for name in _SAMPLING_FLAGS if getattr(args, name) is not None})
    kwargs.update(seed=args.seed, **overrides)
    return SamplingParams(**kwargs)


def describe_sampling(params) -> str:
    """One line a user reads to know how the text was drawn."""
    if params.temperature == 0:
        head = "greedy"
    else:
        head = f"temperature {params.temperature:g}, top_p {params.top_p:g}, top_k {params.top_k}, seed {params.seed}"
    return f"{head}, repetition_penalty {params.repetition_penalty:g}, max_tokens {params.max_tokens}"


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kernel-lab", description="LLM Serving Kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = argv[0] if argv else None
    for name, (module, help_text) in COMMANDS.items():
        if wanted in (None, name, "-h", "--help"):
            _attach(sub, name, module, help_text)
        else:
            sub.add_parser(name, help=help_text)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    for name, (module, help_text) in BENCH_COMMANDS.items():
        _attach(bench, name, module, help_text, prefix="bench_") if wanted == "bench" else bench.add_parser(name)
    env = sub.add_parser("env", help="print the environment record")
    env.set_defaults(_run=_run_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
