"""A folder of safetensors weights, as `save_pretrained` and the released checkpoints lay it out (one
`model.safetensors`, or shards named by `model.safetensors.index.json`'s weight map), read lazily: a tensor at a time,
and headers alone (8 bytes of length, then JSON: each tensor's dtype, shape and byte range) when only names, shapes or
sizes are wanted. The one reader of the project's safetensors: the GGUF writer, the MTP import and the analytics.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from moe_lm.errors import UserError, shown
from moe_lm.files import NotRegular, open_regular

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# bytes per element of each safetensors dtype (F8_E4M3: DeepSeek's FP8 releases)
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}  # fmt: skip
MAX_HEADER = 100_000_000  # safetensors' own limit on a header's JSON


class SafetensorsFolder:
    """The weights in `folder`; `names()`, `shape(name)`, `dtype(name)` read headers only; `tensor(name)` reads one
    tensor; `tensors(names)` streams several, a file at a time. Every error names the file and what to do."""

    def __init__(self, folder: str | Path, fix: str = "export or download it again") -> None:
        self.folder, self.fix = Path(folder), fix
        self._headers: dict[Path, dict[str, dict]] = {}
        index = self.folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                assert isinstance(weight_map, dict)
            except (ValueError, KeyError, TypeError, AssertionError):
                raise UserError(f"{index} is not a safetensors index (no weight_map); {fix}") from None
            self.files = {name: self._shard(index, name, file) for name, file in weight_map.items()}
        else:
            shards = (
                [self.folder / SINGLE]
                if (self.folder / SINGLE).is_file()
                else sorted(self.folder.glob("*.safetensors"))
            )
            if not shards:
                raise UserError(f"{self.folder} holds no .safetensors file; {fix}")
            self.files = {name: shard for shard in shards for name in self._header(shard)}

    def _shard(self, index: Path, name: str, file) -> Path:
        """The shard the index names for tensor `name`: a path inside the folder. why: the index is data from a
        download, and `../..` or an absolute path would read (or wait on) any file of the machine; a shard that is
        itself a symlink (the hub cache's snapshots point into its blobs/) is read where it points."""
        if not isinstance(file, str) or not file or Path(file).is_absolute() or ".." in Path(file).parts:
            raise UserError(f"{index} names {shown(file)} as the file of tensor {name}, which is not a file inside "
                            f"{self.folder}; {self.fix}")  # fmt: skip
        return self.folder / file

    def names(self) -> list[str]:
        return list(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def dtype(self, name: str) -> str:
        return self._entry(name)["dtype"]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: self.shape(name) for name in self.files}

    def nbytes(self, name: str) -> int:
        n = 1
        for d in self.shape(name):
            n *= d
        return n * DTYPE_BYTES.get(self.dtype(name), 4)

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, as stored."""
        return next(self.tensors([name]))[1]

    def tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor as stored) for `names` (default: all), a file open at a time, in the files' order."""
        from safetensors import SafetensorError, safe_open

        wanted = list(self.files) if names is None else list(names)
        if missing := [n for n in wanted if n not in self.files]:
            raise UserError(f"{self.folder}: no tensor {missing[0]!r} in its safetensors files; {self.fix}")
        by_file: dict[Path, list[str]] = {}
        for name in wanted:
            self._entry(name)  # why: its header checked (a FIFO, a header that lies) before safetensors opens it
            by_file.setdefault(self.files[name], []).append(name)
        for file, in_file in by_file.items():
            try:
                with safe_open(file, framework="pt") as f:
                    for name in in_file:
                        yield name, f.get_tensor(name)
            except (SafetensorError, OSError) as e:
                raise UserError(f"{file} is not a readable safetensors file ({e}); {self.fix}") from None

    def _entry(self, name: str) -> dict:
        if name not in self.files:
            raise UserError(f"{self.folder}: no tensor {name!r} in its safetensors files; {self.fix}")
        header = self._header(self.files[name])
        if name not in header:
            raise UserError(f"{self.folder / INDEX} puts tensor {name} in {self.files[name]}, whose header does not "
                            f"list it; {self.fix}")  # fmt: skip
        return header[name]

    def _header(self, file: Path) -> dict[str, dict]:
        """A file's tensors from its header alone (read once), checked: not a regular file, a length past the file,
        JSON that is not a header, offsets that do not tile the data, tensors past the file's end."""
        if file not in self._headers:
            self._headers[file] = self._read_header(file)
        return self._headers[file]

    def _read_header(self, file: Path) -> dict[str, dict]:
        try:
            with open_regular(file) as f:
                size = os.fstat(f.fileno()).st_size
                (n,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
                if size < 8 or n > min(size - 8, MAX_HEADER):
                    raise ValueError(f"a header of {n:,} bytes in a file of {size:,}")
                header, end = checked_tensors(json.loads(f.read(n)))
        except FileNotFoundError:
            raise UserError(f"{file} is missing (named by {self.folder / INDEX}); {self.fix}") from None
        except NotRegular as e:
            raise UserError(f"{file} is {e}, not a safetensors file; {self.fix}") from None
        except (ValueError, UnicodeDecodeError, OSError) as e:
            raise UserError(f"{file} is not a readable safetensors file ({e}); {self.fix}") from None
        if 8 + n + end > size:  # a truncated download: said now, not when the missing tensors are reached
            raise UserError(f"{file} is truncated: its header lists {8 + n + end:,} bytes and it holds {size:,}; "
                            f"{self.fix}")  # fmt: skip
        if 8 + n + end < size:  # safetensors' own reader refuses it too, but only when a tensor is read
            raise UserError(f"{file} is not a readable safetensors file ({size - 8 - n - end:,} bytes after the "
                            f"tensors its header lists); {self.fix}")  # fmt: skip
        return header


def _sizes(value, n: int | None = None) -> bool:
    """Whether `value` is a list of `n` (any number when None) non-negative integers (not booleans)."""
    return (isinstance(value, list) and (n is None or len(value) == n)
            and all(type(v) is int and v >= 0 for v in value))  # fmt: skip


def checked_tensors(header) -> tuple[dict[str, dict], int]:
    """A parsed header's tensors and the bytes they take, checked as safetensors' own reader checks them: each
    entry a dtype, a shape and two offsets; a tensor's bytes those of its shape; the tensors tiling the data from
    byte 0, with no overlap and no gap. A ValueError saying what lies. why here and now: safetensors checks only
    when a file is opened to read a tensor (hours into a streamed analysis), and the plan trusts the shapes (2**50
    values would be planned for)."""
    if not isinstance(header, dict):
        raise ValueError(f"its header is a JSON {type(header).__name__}, not a mapping of tensors")
    tensors = {name: v for name, v in header.items() if name != "__metadata__"}
    spans = []
    for name, v in tensors.items():
        if not (isinstance(v, dict) and isinstance(v.get("dtype"), str) and _sizes(v.get("shape"))
                and _sizes(v.get("data_offsets"), 2)):  # fmt: skip
            raise ValueError(f"tensor {name!r} is not a dtype, a shape and two data_offsets: {shown(v)}")
        (begin, end), numel = v["data_offsets"], 1
        for d in v["shape"]:
            numel *= d
        need = numel * DTYPE_BYTES.get(v["dtype"], 0)
        if v["dtype"] in DTYPE_BYTES and end - begin != need:
            raise ValueError(f"tensor {name!r}, {v['shape']} in {v['dtype']}, takes {need:,} bytes and its "
                             f"data_offsets {v['data_offsets']} give it {end - begin:,}")  # fmt: skip
        spans.append((begin, end, name))
    at, before = 0, None
    for begin, end, name in sorted(spans):
        if begin != at or end < begin:
            why = f"overlaps {before!r}" if begin < at else "ends before it begins" if end < begin else "leaves a gap"
            raise ValueError(f"tensor {name!r} at bytes {begin:,}..{end:,} {why}")
        at, before = end, name
    return tensors, at
