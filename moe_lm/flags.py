"""Typed requests from parsed flags: the analytics' and the benchmarks' settings are frozen dataclasses (callable from
Python), and a command line fills one from the flags of the same names. With `default_of` for the flags' defaults, a
request's defaults are written once, in its dataclass."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TypeVar

T = TypeVar("T")


def from_flags(cls: type[T], args: argparse.Namespace, **given) -> T:
    """The request dataclass `cls` from the parsed flags: each field from `given`, else from the flag of its name."""
    return cls(**{f.name: given[f.name] if f.name in given else getattr(args, f.name) for f in dataclasses.fields(cls)})


def default_of(cls, name: str):
    """A request dataclass's default for field `name` (what its flag defaults to)."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)
