"""The engine's command-line flags, generated from EngineConfig's fields (their defaults, types and the help
text in their metadata), so that every command that builds an engine (`kernel-lab serve`, `generate`,
`demo`, `bench throughput`) takes the same flags with vLLM's names."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from .config import EngineConfig


def _scalar_type(annotation):
    """The command-line type of a field: bool, or the first of int, float, str its annotation allows."""
    options = typing.get_args(annotation) or (annotation,)
    for candidate in (bool, int, float):
        if candidate in options:
            return candidate
    return str


def engine_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.init and "help" in f.metadata]


def add_engine_arguments(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (), **defaults) -> None:
    """One flag per EngineConfig field, e.g. --max-model-len; `defaults` overrides a field's default for this
    command (shown in --help), `exclude` leaves fields out (where the command's own flag of that name
    means something else)."""
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine (EngineConfig)")
    for f in engine_fields():
        if f.name in exclude:
            continue
        flag, default = "--" + f.name.replace("_", "-"), defaults.get(f.name, f.default)
        kind = _scalar_type(hints[f.name])
        help_text = f.metadata["help"] + ("" if "default" in f.metadata["help"] else f" (default: {default})")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=default, choices=f.metadata["choices"], help=help_text)
    if "enable_prefix_caching" not in exclude:  # the name the commands had before vLLM's
        group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                           help=argparse.SUPPRESS)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig's keyword arguments from parsed flags."""
    return {f.name: getattr(args, f.name) for f in engine_fields() if hasattr(args, f.name)}
