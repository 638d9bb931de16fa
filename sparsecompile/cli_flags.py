"""Command-line flags derived from the config dataclasses (``config.py``): one ``--flag-name`` per field, with its
help text and default, so an option is declared once and every command that takes it gets the same flag."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Iterable
from typing import Any


def _flag_type(hint: Any) -> tuple[Callable[[str], Any] | None, str | None]:
    """An argparse type (and nargs) for a field's annotation: the first of int, float, bool, str it admits."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if any(typing.get_origin(a) is list for a in args):
        return int, "+"
    for kind in (bool, int, float, str):
        if kind in args:
            return (parse_bool if kind is bool else kind), None
    return str, None


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_arguments(group: argparse._ActionsContainer, cls: type, *, skip: Iterable[str] = (),
                  dest_prefix: str = "", seen: set[str] | None = None,
                  types: dict[str, Callable[[str], Any]] | None = None) -> list[str]:
    """Add one ``--flag-name`` per field of dataclass ``cls`` (help text and default from :func:`option`).

    Flags default to None, so the caller passes on only what the user gave (the dataclass keeps its defaults).
    ``seen`` collects flags already added (methods share option names: the first definition wins).
    Returns the field names added.
    """
    hints = typing.get_type_hints(cls)
    added = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name in skip or (seen is not None and f.name in seen):
            continue
        kind, nargs = _flag_type(hints.get(f.name, str))
        if types and f.name in types:
            kind = types[f.name]
        default = f.default if f.default is not dataclasses.MISSING else None
        text = f.metadata.get("help", "")
        if default is not None and "default" not in text:
            text = f"{text} (default: {default})"
        group.add_argument(f"--{f.name.replace('_', '-')}", dest=f"{dest_prefix}{f.name}", default=None, type=kind,
                           nargs=nargs, metavar=f.name.upper(), help=text.replace("%", "%%"))
        added.append(f.name)
        if seen is not None:
            seen.add(f.name)
    return added


def given(namespace: argparse.Namespace, names: Iterable[str], dest_prefix: str = "") -> dict[str, Any]:
    """The options among ``names`` that the user set on the command line."""
    values = {name: getattr(namespace, f"{dest_prefix}{name}", None) for name in names}
    return {name: value for name, value in values.items() if value is not None}
