"""CLI flags derived from EngineConfig's fields, so defaults and help live in one place."""

from __future__ import annotations

import argparse
import json
import typing

from pagedserve.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine")
    for f in EngineConfig.settings():
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", [])]
        help_text = f.metadata.get("help", "")
        if hints[f.name] is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            continue
        kind = _scalar_type(hints[f.name])
        if kind is dict:  # given as JSON on the command line; EngineConfig checks it
            kind = _json_object
        # A help text that explains its default itself gets no second one.
        if "default" not in help_text:
            help_text += " (default: %(default)s)"
        group.add_argument(*flags, type=kind, default=f.default, choices=f.metadata.get("choices"), help=help_text)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in EngineConfig.settings()})


def _scalar_type(hint):
    options = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    return options[0]


def _json_object(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
