"""Command-line flags made from an options dataclass: each field's metadata (studio_core.backends.base.option)
names its flag, help and kind, the same metadata the form makes its widgets from (app/fields.py), so an
option is written once. A field's value is read back under the field's own name (args.partition)."""

from __future__ import annotations

import argparse
from dataclasses import fields


def add_flags(group, options_type) -> None:
    """One flag per field of `options_type`, in `group` (a parser or an argument group)."""
    for f in fields(options_type):
        meta = f.metadata
        if meta["kind"] == "bool":
            group.add_argument(meta["flag"], dest=f.name, action="store_true", help=meta["help"])
        elif meta["kind"] == "list":
            group.add_argument(meta["flag"], dest=f.name, action="append", default=[], metavar="OPTION",
                               help=f"{meta['help']} (repeat for more)")
        else:
            group.add_argument(meta["flag"], dest=f.name, help=meta["help"])


def add_layout_flags(parser, layout_type, whole_number, notes: dict[str, str]) -> None:
    """A flag per layout field that names one in its metadata (recipe.spec.Layout): a whole number
    of 1 or more, or text; `notes` adds to a field's help."""
    for f in fields(layout_type):
        if "flag" in f.metadata:
            parser.add_argument(f.metadata["flag"], dest=f.name, type=whole_number(1) if isinstance(f.default, int)
                                else str, help=f"the layout's {f.name} (same as --set studio.{f.name}=..."
                                + (f"; {notes[f.name]}" if f.name in notes else "") + ")")


def layout_flags(layout_type) -> dict[str, str]:
    """The layout fields' flags, by field name."""
    return {f.name: f.metadata["flag"] for f in fields(layout_type) if "flag" in f.metadata}


def given(args: argparse.Namespace, options_type) -> dict:
    """The fields given on the command line, by name: a flag left out is not in it."""
    values = {f.name: getattr(args, f.name, None) for f in fields(options_type)}
    return {name: value for name, value in values.items() if value not in (None, False, [])}


def flags(options_type) -> dict[str, str]:
    """Each field's flag, by field name: the names the command line says problems under."""
    return {f.name: f.metadata["flag"] for f in fields(options_type)}


def repeated(options_types) -> set[str]:
    """The flags that take a list (given once per value) among these dataclasses'."""
    return {f.metadata["flag"] for kind in options_types for f in fields(kind) if f.metadata["kind"] == "list"}


def values_joined(argv: list[str], repeated_flags: set[str]) -> list[str]:
    """`--sbatch-arg --qos=high` as `--sbatch-arg=--qos=high`: argparse takes a value that starts
    with - for an option of its own, so an option's value written after its flag (as README
    writes it) would be refused. The word after a list flag is its value, whatever it is."""
    out, words = [], iter(argv)
    for word in words:
        following = next(words, None) if word in repeated_flags else None
        out.append(word if following is None else f"{word}={following}")
    return out
