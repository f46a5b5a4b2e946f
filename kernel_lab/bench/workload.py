"""What `bench throughput` and `bench serve` share about their workloads: the flags, with vLLM's names, how a
request's length is drawn, and the tokenizer their prompts come from. Their percentiles are the harness's
(`kernel_lab.harness.bench.quantile` and `summarize`)."""

from __future__ import annotations

import argparse
import random
from pathlib import Path


def add_workload_arguments(parser: argparse.ArgumentParser, num_prompts: int, input_len: int, output_len: int) -> None:
    parser.add_argument("--dataset-name", default="random", choices=("random", "fixed"),
                        help="random: lengths drawn within --random-range-ratio; fixed: exact lengths")
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--random-input-len", "--input-len", dest="input_len", type=int, default=input_len)
    parser.add_argument("--random-output-len", "--output-len", dest="output_len", type=int, default=output_len)
    parser.add_argument("--random-range-ratio", "--range-ratio", dest="range_ratio", type=float, default=0.0,
                        help="random dataset: lengths uniform in [len*(1-r), len*(1+r)]")


def draw_length(rng: random.Random, length: int, range_ratio: float) -> int:
    """A length uniform in [length * (1 - r), length * (1 + r)], at least 1; exactly `length` (and no draw)
    when r is 0."""
    if range_ratio <= 0:
        return length
    return rng.randint(max(1, int(length * (1 - range_ratio))), max(1, int(length * (1 + range_ratio))))


def load_tokenizer(spec=None):
    """The engine's Tokenizer for `spec`: a tokenizer.json file, a directory holding one (with its
    tokenizer_config.json, as the engine reads it), a model `resolve_model_dir` takes (a GGUF file or a
    Hugging Face directory), or None for the bundled model's."""
    from kernel_lab.models.loader import resolve_model_dir
    from kernel_lab.models.tokenizer import Tokenizer

    path = Path(spec).expanduser() if spec else None
    if path is not None and path.is_file() and path.suffix == ".json":
        from tokenizers import Tokenizer as Backend

        return Tokenizer(Backend.from_file(str(path)))
    if path is not None and path.is_dir() and not (path / "config.json").is_file():
        return Tokenizer.from_directory(path)  # a tokenizer without a model
    return Tokenizer.from_directory(resolve_model_dir(spec, float_weights=False))
