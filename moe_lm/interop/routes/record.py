"""What a record of routes is, whoever recorded it (a serving engine, a trainer): sequences of token ids from their
first position, the experts each routed token went to, and what was left out. Every format of this room reads into
it; moe_lm/analysis/subjects/routes.py makes a subject of it.

Also the checks every reader shares, so that a record that is not as its engine writes it is one DataError naming
the file (and line or pass), never a traceback, a hang or all of the memory: files opened without waiting on a FIFO,
lines read with a cap, JSON without recursion errors, integers that are integers (not floats or booleans, which
numpy would silently turn into ids), and .npy bytes whose header is checked against their length before numpy
allocates the array it declares; and, for the writers, routes put on the engines' axis of every decoder layer."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from moe_lm import files
from moe_lm.errors import DataError

# why a cap: a line is parsed whole, and one line can be anything; a DeepSeek-V3 response of 160k tokens holds 427 MB
# of base64 routes (SGLang's int32), so a longer line is not a response of any served model
MAX_LINE_BYTES = 1 << 30


@dataclass
class Sequence:
    """One request's tokens from position 0 and the routes of its routed tokens, `routes[i]` for `tokens[i]`
    ([n, engine layers, k], n <= len(tokens)); `domain`: what the record says it is (None: not said)."""

    tokens: np.ndarray
    routes: np.ndarray
    domain: str | None = None


@dataclass
class Record:
    """What a file held: its format, its sequences, and what was left out (and why), for the console. `layers`: the
    decoder layers a sequence's routes hold, in order, where the record names them (None: every decoder layer, the
    serving engines' axis); `ranked`: whether each token's experts come first choice first; `filler`: what the
    engine writes in the rows of layers it did not route (dense layers: 0 in responses, -1 in dumps and traces)."""

    format: str
    sequences: list[Sequence]
    skipped: dict[str, int] = field(default_factory=dict)  # why -> tokens (responses, for NO_ROUTES)
    layers: list[int] | None = None
    ranked: bool = True
    filler: int = -1


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading if it is a regular file; a FIFO, a device or a folder is a DataError naming what it
    is (any name in a record's folder can be a FIFO, which plain open() would wait on)."""
    try:
        return files.open_regular(path)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except files.NotRegular as e:
        raise DataError(f"{path} is {e}: a record's files are regular files (remove it or name another)") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})") from None


def capped_lines(f: BinaryIO, path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of every line that is not blank, each read up to MAX_LINE_BYTES (a longer one is a
    DataError: nothing is read past the cap)."""
    n = 0
    while line := f.readline(MAX_LINE_BYTES + 1):
        n += 1
        if len(line) > MAX_LINE_BYTES:
            raise DataError(f"{path}, line {n}: longer than {MAX_LINE_BYTES:,} bytes, more than any response or "
                            "trace record holds: not a record of routes")  # fmt: skip
        if line.strip():
            yield n, line


def json_value(line: bytes, where: str):
    """The JSON value of one line; not JSON, or nested deeper than the parser recurses, is a DataError."""
    try:
        return json.loads(line)
    except RecursionError:  # why: json.loads recurses per nesting level; a record nests three levels deep
        raise DataError(f"{where}: JSON nested too deeply to be a record of routes") from None
    except ValueError as e:
        raise DataError(f"{where}: not JSON ({str(e)[:80]}); one record per line") from None


def is_int(value) -> bool:
    """An integer as JSON or a Python list holds it: not a boolean (an int to Python) or a float (numpy would cast
    either to an id without a word)."""
    return type(value) is int  # noqa: E721 - exactly int: bool is a subclass


def integer(value, what: str, where: str, low: int = 0) -> int:
    """`value` as an int of at least `low`, or a DataError naming the field."""
    if not is_int(value) or value < low:
        raise DataError(f"{where}: {what} is {str(value)[:40]!r}, not an integer of at least {low}")
    return value


def int_array(value, what: str, where: str, ndim: int) -> np.ndarray:
    """`value` (a tensor, an array or nested lists of ints) as an int64 array of `ndim` dimensions, or a DataError:
    floats, booleans, strings and ragged lists are not ids."""
    if hasattr(value, "numpy") and hasattr(value, "dtype"):  # a torch tensor (a dump's), without importing torch
        value = value.numpy()
    if isinstance(value, np.ndarray):
        array = value
    else:
        if not _ints_nested(value, ndim):
            raise DataError(f"{where}: {what} is not {ndim}-dimensional lists of integers")
        try:
            array = np.asarray(value)
        except ValueError:  # rows of other lengths
            raise DataError(f"{where}: {what} holds rows of different lengths") from None
    if array.dtype.kind not in "iu" or array.ndim != ndim:
        raise DataError(f"{where}: {what} is {array.dtype} of shape {array.shape}, not {ndim}-dimensional integers")
    return array.astype(np.int64, copy=False)


def _ints_nested(value, ndim: int) -> bool:
    """Whether `value` is `ndim` levels of lists with ints (exactly) at the bottom."""
    if not isinstance(value, list):
        return False
    if ndim == 1:
        return all(type(v) is int for v in value)  # noqa: E721
    return all(_ints_nested(v, ndim - 1) for v in value)


def npy_array(f: BinaryIO, size: int, what: str, where: str) -> np.ndarray:
    """The integer array of .npy bytes (`f` at their start, `size` bytes long), its header checked against the bytes
    that follow it before anything is allocated (np.load allocates the shape a header declares, whatever the file
    holds); object arrays (pickles) are refused unread."""
    try:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{where}: {what} is not .npy bytes ({str(e)[:80]})") from None
    if dtype.hasobject or dtype.kind not in "iu":
        raise DataError(f"{where}: {what} holds {dtype} values, not integer ids (object arrays are never unpickled)")
    count = math.prod(shape)  # why not np.prod: a declared shape can overflow int64 and wrap to a small count
    left = size - f.tell()
    if count * dtype.itemsize != left:
        raise DataError(f"{where}: {what} declares {dtype} {tuple(shape)} ({count * dtype.itemsize:,} bytes) but "
                        f"holds {left:,} bytes: cut short, or not written by the engine")  # fmt: skip
    array = np.frombuffer(f.read(left), dtype=dtype, count=count)
    return array.reshape(shape, order="F" if fortran else "C")


def engine_routes(experts: dict[int, np.ndarray], n_layers: int, k: int, dense: int) -> np.ndarray:
    """[tokens, n_layers, k] with each MoE layer's experts [tokens, k] in its row and `dense` in the other layers'
    rows: the engines' axis of every decoder layer (writers, tests)."""
    n = len(next(iter(experts.values())))
    routes = np.full((n, n_layers, k), dense, dtype=np.int64)
    for layer, ids in experts.items():
        routes[:, layer, :] = ids
    return routes
