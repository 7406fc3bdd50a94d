"""A GGUF file's header, read by moe-lm before any other reader sees the file: every count and length checked
against the bytes the file has, so that a damaged or hostile header is one line naming the file, never a reader
that trusts it (gguf-py 0.19's reader allocates what a length field says: 49 bytes declaring a 2**62-element array
took 3.4 GB and 19 s before llama.cpp refused it), and never a FIFO waited on.

The layout (GGUF versions 2 and 3, as ggml/src/gguf.cpp reads them, little-endian):
    "GGUF", version u32, tensor count u64, key-value count u64
    each key-value: key (u64 length + UTF-8), value type u32, value
        scalars u8 i8 u16 i16 u32 i32 f32 bool u64 i64 f64; a string (u64 length + bytes);
        an array: element type u32, count u64, elements (arrays of arrays are refused, as gguf.cpp refuses them)
    each tensor: name (string), n_dims u32 (at most 4), dims u64 x n_dims, ggml type u32, offset u64
    padding to `general.alignment` (default 32), then the tensors' data (each offset from there)
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moe_lm import files
from moe_lm.errors import UserError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
# value type -> (struct format, numpy dtype) of the fixed-size scalars; 8 is a string, 9 an array
SCALARS = {0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
           5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "<u1"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
           12: ("<d", "<f8")}  # fmt: skip
STRING, ARRAY = 8, 9


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml's order: ne0 (the contiguous dimension) first
    type: int  # ggml type id
    offset: int  # from the start of the data section


@dataclass
class GGUFHeader:
    path: Path
    version: int
    fields: dict[str, object] = field(default_factory=dict)  # key -> int, float, bool, str, or a list / array
    tensors: list[TensorInfo] = field(default_factory=list)
    data_offset: int = 0
    size: int = 0  # the file's bytes

    @property
    def arch(self) -> str:
        return str(self.fields.get("general.architecture", "?"))

    def get(self, key: str, default=None):
        """A key of the architecture (`expert_count` -> `<arch>.expert_count`) or a full key."""
        return self.fields.get(f"{self.arch}.{key}", self.fields.get(key, default))


class _Bytes:
    """Reads a file from its start, refusing any length that would run past its end; what it reads is held (the
    header: a few MB at most), fetched a MiB at a time."""

    def __init__(self, fd: int, size: int, path: Path) -> None:
        self.fd, self.size, self.path = fd, size, path
        self.buf, self.at = bytearray(), 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.at + n > self.size:
            raise UserError(
                f"{self.path}: damaged GGUF header: {what} needs {n:,} bytes at offset {self.at:,} but the file has "
                f"{self.size:,}; the file is truncated or not a GGUF model (download or convert it again)"
            )
        while len(self.buf) < self.at + n:
            more = os.pread(self.fd, max(self.at + n - len(self.buf), 1 << 20), len(self.buf))
            if not more:  # the file shrank while it was read
                raise UserError(f"{self.path}: the file changed while its header was read")
            self.buf += more

    def scalar(self, kind: int, what: str):
        fmt = SCALARS[kind][0]
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += size
        return value

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        self.need(n, what)
        raw = bytes(self.buf[self.at : self.at + n])
        self.at += n
        return raw.decode("utf-8", "replace")

    def array(self, what: str):
        kind = self.u32(f"the element type of {what}")
        count = self.u64(f"the length of {what}")
        if kind == STRING:
            self.need(8 * count, f"{count:,} strings of {what}")  # each at least its 8-byte length
            return [self.string(f"element {i} of {what}") for i in range(count)]
        if kind not in SCALARS:
            raise UserError(f"{self.path}: damaged GGUF header: {what} is an array of type {kind}, which GGUF does "
                            "not define (arrays of arrays included); the file is not one llama.cpp reads")  # fmt: skip
        dtype = np.dtype(SCALARS[kind][1])
        self.need(count * dtype.itemsize, f"{count:,} elements of {what}")
        values = np.frombuffer(bytes(self.buf[self.at : self.at + count * dtype.itemsize]), dtype).copy()
        self.at += count * dtype.itemsize
        return values.astype(bool) if kind == 7 else values

    def value(self, kind: int, what: str):
        if kind == STRING:
            return self.string(what)
        if kind == ARRAY:
            return self.array(what)
        if kind not in SCALARS:
            raise UserError(f"{self.path}: damaged GGUF header: {what} has value type {kind}, which GGUF does not "
                            "define; the file is not one llama.cpp reads")  # fmt: skip
        return self.scalar(kind, what)


def open_regular(path: Path) -> int:
    """A read-only descriptor of `path` if it is a regular file (files.open_regular: never waits on a FIFO), and a
    UserError naming what it is otherwise."""
    try:
        with files.open_regular(path) as f:
            return os.dup(f.fileno())
    except FileNotFoundError:
        raise UserError(f"{path}: no such GGUF file") from None
    except files.NotRegular as e:
        raise UserError(f"{path} is {e}, not a GGUF file") from None
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror})") from None


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a regular file that starts with GGUF's magic (without waiting on a FIFO)."""
    try:
        fd = open_regular(Path(path))
    except UserError:
        return False
    try:
        return os.pread(fd, 4, 0) == MAGIC
    finally:
        os.close(fd)


def read_gguf_header(path: str | Path, tensors: bool = True) -> GGUFHeader:
    """The header of a GGUF file, every length checked against the file's size (and with `tensors`, every tensor's
    data lying inside the file); a UserError naming the file and the first thing that does not fit."""
    path = Path(path)
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size < 4 or os.pread(fd, 4, 0) != MAGIC:
            head = os.pread(fd, 4, 0)
            raise UserError(f"{path} is not a GGUF file (it starts with {head!r}, not {MAGIC!r})")
        return _parse(_Bytes(fd, size, path), size, tensors)
    finally:
        os.close(fd)


def _parse(r: _Bytes, size: int, with_tensors: bool) -> GGUFHeader:
    r.at = 4
    version = r.u32("the version")
    if version not in VERSIONS:
        raise UserError(f"{r.path}: GGUF version {version}; llama.cpp reads versions {VERSIONS} (convert it again)")
    n_tensors, n_kv = r.u64("the tensor count"), r.u64("the key-value count")
    # each key-value takes at least 8 (key length) + 4 (type) bytes, each tensor 8 + 4 + 4 + 8
    r.need(12 * n_kv + 24 * n_tensors, f"{n_kv:,} key-values and {n_tensors:,} tensors")
    header = GGUFHeader(r.path, version, size=size)
    for i in range(n_kv):
        key = r.string(f"key {i}")
        if key in header.fields:
            raise UserError(f"{r.path}: damaged GGUF header: the key {key!r} appears twice")
        header.fields[key] = r.value(r.u32(f"the type of {key}"), key)
    for i in range(n_tensors):
        name = r.string(f"the name of tensor {i}")
        n_dims = r.u32(f"the dimensions of {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise UserError(f"{r.path}: damaged GGUF header: tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS})")
        shape = tuple(r.u64(f"a dimension of {name}") for _ in range(n_dims))
        header.tensors.append(TensorInfo(name, shape, r.u32(f"the type of {name}"), r.u64(f"the offset of {name}")))
    alignment = header.fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise UserError(f"{r.path}: damaged GGUF header: general.alignment is {alignment!r} (a power of two)")
    header.data_offset = -(-r.at // alignment) * alignment
    if with_tensors:
        _check_tensor_data(header)
    return header


def _check_tensor_data(header: GGUFHeader) -> None:
    """Each tensor's bytes (its ggml type's block size and bytes per block) lie inside the file."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for t in header.tensors:
        try:
            block, per_block = GGML_QUANT_SIZES[GGMLQuantizationType(t.type)]
        except (ValueError, KeyError):
            raise UserError(f"{header.path}: tensor {t.name} has ggml type {t.type}, which this gguf package does not "
                            "know; update gguf (pip install -U gguf) or convert the file again") from None  # fmt: skip
        if any(d == 0 for d in t.shape) or t.shape[0] % block:
            raise UserError(f"{header.path}: damaged GGUF header: tensor {t.name} has shape {list(t.shape)}, not whole "
                            f"blocks of {block} for its type")  # fmt: skip
        nbytes = t.shape[0] // block * per_block * int(np.prod(t.shape[1:], dtype=object))
        end = header.data_offset + t.offset + nbytes
        if end > header.size:
            raise UserError(
                f"{header.path}: tensor {t.name} ({nbytes:,} bytes at {header.data_offset + t.offset:,}) runs past the "
                f"end of the file ({header.size:,} bytes): the file is truncated; download or convert it again"
            )


def tensor_types(header: GGUFHeader) -> str:
    """'12 Q4_K, 8 Q6_K, 30 F32, ...': the tensors by type, most first."""
    from collections import Counter

    from gguf.constants import GGMLQuantizationType

    counts = Counter(GGMLQuantizationType(t.type).name for t in header.tensors)
    return ", ".join(f"{n} {name}" for name, n in counts.most_common())
