"""Command-line flags for every EngineConfig field, so the CLI and configs never list them by hand."""
from __future__ import annotations

import argparse
import dataclasses
import json
import typing

from engine.config import EngineConfig

_SKIPPED = {"model"}


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if field.name in _SKIPPED:
            continue
        flag = "--" + field.name.replace("_", "-")
        hint = hints[field.name]
        default = field.default if field.default is not dataclasses.MISSING else None
        if hint is bool:
            group.add_argument(flag, type=_parse_bool, default=None, metavar="BOOL",
                               help=f"(default: {default})")
        elif hint is dict or hint is typing.Any:  # mappings (hf_overrides, speculative_config)
            group.add_argument(flag, type=_json_object, default=None, metavar="JSON", help="(JSON object)")
        else:
            base = int if "int" in str(hint) else float if "float" in str(hint) else str
            group.add_argument(flag, type=base, default=None, help=f"(default: {default})")


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    """Only the flags the user gave, so EngineConfig's defaults stay the single source of defaults."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
            if f.name not in _SKIPPED and getattr(args, f.name, None) is not None}
