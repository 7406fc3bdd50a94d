"""A folder of safetensors weights, as `save_pretrained` and the released checkpoints lay it out (one
`model.safetensors`, or shards named by `model.safetensors.index.json`'s weight map), read lazily: a tensor at a time,
and headers alone (8 bytes of length, then JSON: each tensor's dtype, shape and byte range) when only names, shapes or
sizes are wanted. The one reader of the project's safetensors: the GGUF writer, the MTP import and the analytics.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from moe_lm.errors import UserError

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
            self.files = {name: self.folder / file for name, file in weight_map.items()}
        else:
            shards = (
                [self.folder / SINGLE]
                if (self.folder / SINGLE).is_file()
                else sorted(self.folder.glob("*.safetensors"))
            )
            if not shards:
                raise UserError(f"{self.folder} holds no .safetensors file; {fix}")
            self.files = {name: shard for shard in shards for name in self._header(shard)}

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
        return self._header(self.files[name])[name]

    def _header(self, file: Path) -> dict[str, dict]:
        """A file's tensors from its header alone (read once), checked: a length past the file, JSON that is not a
        header, tensors past the file's end."""
        if file not in self._headers:
            self._headers[file] = self._read_header(file)
        return self._headers[file]

    def _read_header(self, file: Path) -> dict[str, dict]:
        try:
            with open(file, "rb") as f:
                size = file.stat().st_size
                (n,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
                if size < 8 or n > min(size - 8, MAX_HEADER):
                    raise ValueError(f"a header of {n:,} bytes in a file of {size:,}")
                header = json.loads(f.read(n))
        except FileNotFoundError:
            raise UserError(f"{file} is missing (named by {self.folder / INDEX}); {self.fix}") from None
        except (ValueError, UnicodeDecodeError, OSError) as e:
            raise UserError(f"{file} is not a readable safetensors file ({e}); {self.fix}") from None
        header.pop("__metadata__", None)
        if not all(isinstance(v, dict) and "shape" in v and "dtype" in v for v in header.values()):
            raise UserError(f"{file} is not a readable safetensors file (its header lists no tensors); {self.fix}")
        end = max((v.get("data_offsets", [0, 0])[1] for v in header.values()), default=0)
        if 8 + n + end > size:  # a truncated download: said now, not when the missing tensors are reached
            raise UserError(f"{file} is truncated: its header lists {8 + n + end:,} bytes and it holds {size:,}; "
                            f"{self.fix}")  # fmt: skip
        return header
