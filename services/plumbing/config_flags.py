"""Command-line flags generated from a service's frozen config dataclass.

A field declared with option(...), or with a "help" in its metadata (the manager's core
declares its config so, importing nothing), is a flag: `--name-with-dashes` (or "flag"), its
help, how to parse it; its default is the dataclass's, stated nowhere else. The parser keeps only
what the user gave (argparse.SUPPRESS), from_args fills the rest from the dataclass, and the
dataclass validates the whole, so a bad value fails the same way from any launcher. to_argv
turns a config back into the flags that differ from the defaults: `kvserve up` hands each
child process its config that way.

    @dataclass(frozen=True)
    class Config:
        num_pages: int = option(4096, "device KV pages")
        prefix_caching: bool = option(True, "share KV pages between requests")  # --no-prefix-caching

    add_arguments(parser, Config)
    config = from_args(Config, parser.parse_args(argv))
    assert from_args(Config, parser.parse_args(to_argv(config))) == config
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

C = TypeVar("C")

EXIT_BAD_FLAGS = 2   # what argparse exits with for what it refuses itself


class BadFlags(SystemExit):
    """A command line no run of the command could take: a flag's value, flags that contradict
    each other, one missing. Exits EXIT_BAD_FLAGS, as argparse's own refusals do; a file or a
    model it cannot use exits 1, an address it cannot listen on 3. The `kvserve` command prints
    the message (str() of it): raised past it, the exit would be silent, its code an int."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_BAD_FLAGS)
        self.message = message

    def __str__(self) -> str:
        return self.message


def option(default: Any, help: str, *, flag: str | None = None, parse: Callable[[str], Any] | None = None,
           choices: Iterable[str] | None = None, metavar: str | None = None, hidden: bool = False) -> Any:
    """A config field that is also a command-line flag. `choices` are listed in the help
    (the dataclass validates them); `parse` turns the text into the value (default: the
    field's type); a `hidden` flag is left out of --help."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults: use a tuple")
    return dataclasses.field(default=default, metadata={
        "help": help, "flag": flag, "parse": parse, "choices": tuple(choices) if choices else None,
        "metavar": metavar, "hidden": hidden})


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def options(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are flags, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def add_arguments(parser: argparse.ArgumentParser, cls: type, exclude: Iterable[str] = ()) -> None:
    """One flag per option of `cls`, except the fields named in `exclude`."""
    hints = typing.get_type_hints(cls)
    skip = set(exclude)
    for f in options(cls):
        if f.name in skip:
            continue
        meta, kind = f.metadata, _base_type(hints[f.name])
        notes = [" | ".join(meta["choices"])] if meta.get("choices") else []
        if f.default not in (None, "") and kind is not bool and not isinstance(f.default, tuple):
            notes.append(f"default {f.default}")
        text = meta["help"] + (f" ({'; '.join(notes)})" if notes else "")
        if meta.get("hidden"):
            text = argparse.SUPPRESS
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": text}
        if kind is bool:
            parser.add_argument(_bool_flag(f), action="store_false" if f.default else "store_true", **kwargs)
            continue
        kwargs["type"] = meta.get("parse") or kind
        kwargs["metavar"] = meta.get("metavar") or flag_of(f).lstrip("-").replace("-", "_").upper()
        if isinstance(f.default, tuple):
            kwargs["action"] = "append"   # repeat the flag for several values
        parser.add_argument(flag_of(f), **kwargs)


def from_args(cls: type[C], args: argparse.Namespace, prog: str = "kvserve") -> C:
    """The config the user asked for: the flags given, the dataclass's defaults for the rest.
    A value the dataclass refuses exits with its message."""
    given = {f.name: getattr(args, f.name) for f in options(cls) if hasattr(args, f.name)}
    for f in options(cls):
        if isinstance(f.default, tuple) and f.name in given:
            given[f.name] = tuple(given[f.name])
    try:
        return cls(**given)
    except ValueError as exc:
        raise BadFlags(f"{prog}: {_as_flag(cls, str(exc))}") from None


def _as_flag(cls: type, message: str) -> str:
    """A library config's message names its field ("num_pages must be ..."); a user typed the flag."""
    name, sep, rest = message.partition(" ")
    for f in options(cls):
        if sep and name == f.name:
            return f"{flag_of(f)} {rest}"
    return message


def to_argv(config: Any) -> list[str]:
    """The flags that give `config` back through from_args: those whose value is not the
    default (the child's dataclass supplies the rest). `--flag=value`, so that a value that
    starts with a dash stays a value."""
    hints = typing.get_type_hints(type(config))
    argv: list[str] = []
    for f in options(type(config)):
        value = getattr(config, f.name)
        if value == f.default:
            continue
        if _base_type(hints[f.name]) is bool:
            argv.append(_bool_flag(f))
        elif isinstance(value, tuple):
            argv += [f"{flag_of(f)}={item}" for item in value]
        else:
            argv.append(f"{flag_of(f)}={value}")
    return argv


def _bool_flag(field: dataclasses.Field) -> str:
    """A bool flag turns its default off or on: --no-NAME for a True default."""
    return field.metadata.get("flag") or ("--no-" if field.default else "--") + field.name.replace("_", "-")


def _base_type(hint: Any) -> type:
    """int for `int | None`, str for `tuple[str, ...]`, the type itself otherwise."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is tuple:
        hint = typing.get_args(hint)[0]
    return hint


MAX_REQUEST_BYTES = 2**31 - 1   # gRPC's message limits are C ints


def parse_bytes(text: str) -> int:
    """A size: 512MiB, 2GiB, 1000000."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
             "gib": 2**30, "tib": 2**40}
    t = text.strip().lower()
    num = t.rstrip("kmgtib")
    try:
        return int(float(num) * units[t[len(num):]])
    except (KeyError, ValueError, OverflowError):   # OverflowError: inf
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB, 1000000)") from None
