"""Benchmarks, one module each, over one shared timing method (timing.py): `moe-lm bench <what>` (moe_lm/cli/bench.py),
also `python -m moe_lm.bench <what>`. A benchmark's helpers take a typed request (a frozen dataclass of the settings
they read), built from its flags by `from_flags`, so that they can be called from Python as well."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TypeVar

T = TypeVar("T")


def from_flags(cls: type[T], args: argparse.Namespace) -> T:
    """The request dataclass `cls` with each field taken from the parsed flag of the same name."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
