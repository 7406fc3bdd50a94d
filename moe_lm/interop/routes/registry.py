"""What a format of route records is (`RouteFormat`) and the registry of them, in the order they are tried:
`read_record` and `looks_like_record`, the entry points, go down that list."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

from moe_lm.errors import DataError
from moe_lm.interop.routes.record import Record


class RouteFormat(ABC):
    """A format in which an engine or a trainer records routes. Declares `name` (what `Record.format` and the console
    call it), `looks_like` (its files in a few words, for a path that is no record) and `order` (where it is tried:
    lower first; it matters only where two formats could both take a path, e.g. a folder holding two engines' files);
    recognises a path by its content, reads it as its engine writes it and writes it the same way (tests,
    conversions)."""

    name: ClassVar[str]
    looks_like: ClassVar[str]
    order: ClassVar[int] = 100

    @abstractmethod
    def recognises(self, path: Path) -> bool:
        """Whether `path` (a file or a folder) is a record of this format by its content, whatever its name (what
        `--compare` asks); never waits on a FIFO, never holds more than a bounded part of a file."""

    def claims(self, path: Path) -> bool:
        """Whether this format's reader reads `path` when no format recognises it: a file in its container (JSON
        lines, a torch.save zip) whose content is not as the engine writes it, so that its reader refuses it naming
        the file, the line or pass and what is wrong, rather than as no record at all. None by default."""
        return False

    @abstractmethod
    def read(self, path: Path) -> Record:
        """The record's sequences; a DataError naming the file (and line or pass) for anything not as the engine
        writes it."""

    @abstractmethod
    def write(self, path: Path, record: Record) -> None:
        """`record`'s sequences written at `path` as the engine writes them; a format may take options of its own
        (keywords with defaults)."""


FORMATS: list[RouteFormat] = []  # in the order they are tried


def register_route_format(fmt: RouteFormat) -> None:
    """Add `fmt` to the registry in its `order` (after the formats of the same order already there)."""
    at = next((i for i, f in enumerate(FORMATS) if f.order > fmt.order), len(FORMATS))
    FORMATS.insert(at, fmt)


def recognised(path: Path) -> RouteFormat | None:
    """The first format that recognises `path`, or None."""
    return next((f for f in FORMATS if f.recognises(path)), None)


def read_record(path: str | Path) -> Record:
    """The sequences of a record, read by the first format that recognises it (else by the first that claims it);
    a DataError naming the file, the line or pass, and what is wrong for anything that is not as the engine writes
    it."""
    path = Path(path)
    fmt = recognised(path) or next((f for f in FORMATS if f.claims(path)), None)
    if fmt is None:
        raise DataError(f"{path}: not a record of routes moe-lm reads (" + "; ".join(f.looks_like for f in FORMATS)
                        + ")")  # fmt: skip
    return fmt.read(path)


def looks_like_record(path: str | Path) -> bool:
    """Whether `path` is a record by its content, whatever its name (what --compare recognises)."""
    return recognised(Path(path)) is not None
