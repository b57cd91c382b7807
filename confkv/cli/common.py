"""What the ``confkv`` subcommands share: argument types, help texts, removed flags, ``--param`` parsing, output.

Every command module of :mod:`confkv.cli` takes these from here rather than from each other.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

MODEL_HELP = "'smollm2' (bundled), 'gemma3-270m' (optional package), a local path or a hub id"


def ints(text: str) -> list[int]:
    return [int(x) for x in str(text).replace(" ", "").split(",") if x]


def floats(text: str) -> list[float]:
    return [float(x) for x in str(text).replace(" ", "").split(",") if x]


def strs(text: str) -> list[str]:
    return [x for x in str(text).replace(" ", "").split(",") if x]


class _Removed(argparse.Action):
    """A flag that was removed: using it stops the parser with what to give instead."""

    def __init__(self, option_strings: list[str], dest: str, instead: str = "", **kwargs: Any) -> None:
        kwargs.setdefault("nargs", "?")
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.instead = instead

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} was removed with the offline budget matching; {self.instead}")


def removed_flags(parser: argparse.ArgumentParser, flags: tuple[str, ...], instead: str) -> None:
    """Register ``flags`` as removed: each one is an error that says ``instead``."""
    for flag in flags:
        parser.add_argument(flag, action=_Removed, instead=instead, dest=f"removed_{flag.strip('-')}")


def memory_fraction(text: str) -> float:
    """A ``--memory`` value: a fraction in (0, 1] of the full cache's bytes."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a fraction of the full cache's bytes "
                                         "in (0, 1], e.g. 0.25") from None
    if not 0.0 < value <= 1.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]; give a fraction of the full cache's bytes, "
                                         "e.g. 0.25")
    return value


def memory_fractions(text: str) -> list[float]:
    """Comma-separated ``--memory`` values, e.g. ``0.25,0.125``."""
    values = [memory_fraction(x) for x in str(text).replace(" ", "").split(",") if x]
    if not values:
        raise argparse.ArgumentTypeError("give at least one fraction, e.g. 0.25,0.125")
    return values


MEMORY_HELP = ("each cache holds this fraction of the full cache's bytes at the end of every step (the full "
               "cache: transformers' DynamicCache at the same length); policies may be presets (tiered, kivi-4, "
               "kivi-2)")


def set_threads(args: argparse.Namespace) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def parse_params(items: list[str] | None) -> dict[str, Any]:
    """``['key=value', ...]`` from ``--param`` -> dict (values parsed as JSON when possible)."""
    params: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"--param expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            params[key.replace("-", "_")] = json.loads(raw)
        except json.JSONDecodeError:
            params[key.replace("-", "_")] = raw
    return params
