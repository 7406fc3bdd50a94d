"""Typed requests from parsed flags: the analytics' and the benchmarks' settings are frozen dataclasses (callable from
Python), and a command line fills one from the flags of the same names. With `default_of` for the flags' defaults, a
request's defaults are written once, in its dataclass. Flag types the commands and benchmarks share: `torch_device`."""

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


def torch_device(value: str) -> str:
    """An argparse type for --device: a torch device's name (`cpu`, `cuda`, `cuda:1`, ...); whether this machine has
    it is `usable_device`'s to say, when the command runs (a documented command line parses anywhere)."""
    import torch

    try:
        torch.device(value)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{value!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    return value


def usable_device(value: str, flag: str = "--device") -> None:
    """A UserError unless this machine has the device `value` names, before anything is built on it: a GPU the machine
    lacks was a traceback from deep inside torch."""
    import torch

    from moe_lm.errors import UserError

    device = torch.device(value)
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)
    if backend is None or not backend.is_available():
        cpu_build = device.type == "cuda" and not torch.version.cuda
        build = f"torch {torch.__version__}" + (", a CPU build" if cpu_build else "")
        raise UserError(f"{flag} {value}: this machine has no {device.type} device ({build}); use {flag} cpu")
    if device.index is not None and device.index >= backend.device_count():
        raise UserError(f"{flag} {value}: this machine has {backend.device_count()} {device.type} device(s)")


SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
              "gib": 2**30, "tib": 2**40}  # fmt: skip


def byte_size(value: str) -> int:
    """An argparse type for a size: `64GiB`, `500MB`, `1.5TiB`, or bytes."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    unit = m[2].lower() if m else None
    if not m or unit not in SIZE_UNITS or float(m[1]) <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a size (e.g. 64GiB, 500MB, 1.5TiB)")
    if (size := int(float(m[1]) * SIZE_UNITS[unit])) < 1:  # why: half a byte rounds to 0, which reads as no limit
        raise argparse.ArgumentTypeError(f"{value!r} is less than a byte")
    return size
