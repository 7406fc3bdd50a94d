"""Token shards: one memory-mapped token array per split plus document and domain indices.

On disk, per split folder (train/, val/):
    tokens.bin         uint16 (vocab <= 65535) or uint32, all documents back to back, each starting with BOS
    doc_offsets.npy    int64 [D + 1]: document d is tokens[doc_offsets[d]:doc_offsets[d + 1]]
    doc_domain.npy     int16 [D]: index into the dataset's domain list
    doc_names.json     [D] document names (their origin), for analytics and the manifest

meta.json records each split's tokens.bin hash (xxh3-128); a reader checks it and the largest token id against the
vocabulary once per file and process (`TokenShard(..., vocab_size=...)`), so a damaged shard is an error naming the
file before training indexes the embedding with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import xxhash

from moe_lm.errors import DataError

HASH = "xxh3_128"  # as in checkpoints (moe_lm/checkpoint/format.py): fast; it guards against rot, not an adversary
SCAN_CHUNK = 1 << 23  # tokens per step of the one pass that hashes a shard and finds its largest id
_verified: set[tuple] = set()  # (tokens.bin, size, mtime, vocab, hash) already scanned in this process


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of a split's token frequencies: the loss of the best context-free predictor."""
    p = np.bincount(np.asarray(tokens), minlength=vocab_size).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


class ShardWriter:
    """Streams documents to disk; nothing but the index is held in memory."""

    def __init__(self, folder: Path, vocab_size: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.dtype = token_dtype(vocab_size)
        self.file = open(folder / "tokens.bin", "wb")  # noqa: SIM115 - closed in close()
        self.offsets = [0]
        self.domains: list[int] = []
        self.names: list[str] = []

    def add(self, parts: Iterable[list[int]], domain_id: int, name: str) -> int:
        """One document, its token ids in consecutive parts (a long document's, encoded a chunk at a time, so that
        its ids are never all in memory); returns how many."""
        n = 0
        for part in parts:
            # why write(tobytes()) and not tofile(): tofile costs ~9 us a call, which one call per part would add
            self.file.write(np.asarray(part, dtype=self.dtype).tobytes())
            n += len(part)
        self.offsets.append(self.offsets[-1] + n)
        self.domains.append(domain_id)
        self.names.append(name)
        return n

    def close(self) -> None:
        self.file.close()
        np.save(self.folder / "doc_offsets.npy", np.asarray(self.offsets, dtype=np.int64))
        np.save(self.folder / "doc_domain.npy", np.asarray(self.domains, dtype=np.int16))
        (self.folder / "doc_names.json").write_text(json.dumps(self.names))
        (self.folder / "shard.json").write_text(json.dumps({"dtype": self.dtype.name, "n_tokens": self.offsets[-1]}))


class TokenShard:
    """Read side of one split: `tokens` is a read-only memmap; indices are small arrays. With `vocab_size`, tokens.bin
    is scanned once: every id must be below it and, when `content_hash` is given (meta.json's), the file must be the
    one preparation wrote."""

    def __init__(
        self, folder: str | Path, domains: list[str], vocab_size: int | None = None, content_hash: str | None = None
    ) -> None:
        folder = Path(folder)
        self.domains = domains
        self._folder = folder
        try:
            meta = json.loads((folder / "shard.json").read_text())
            n, dtype = int(meta["n_tokens"]), np.dtype(meta["dtype"])
            self.doc_offsets = np.load(folder / "doc_offsets.npy")
            self.doc_domain = np.load(folder / "doc_domain.npy")
        except (OSError, ValueError, KeyError, TypeError, EOFError) as e:  # missing, truncated or garbled files
            raise _corrupt(folder, f"{type(e).__name__}: {e}") from None
        size = (folder / "tokens.bin").stat().st_size if (folder / "tokens.bin").is_file() else -1
        if size != n * dtype.itemsize:
            raise _corrupt(folder, f"tokens.bin has {size} bytes, shard.json promises {n} x {dtype.itemsize}")
        o = self.doc_offsets
        if len(o) != len(self.doc_domain) + 1 or o[0] != 0 or o[-1] != n or (np.diff(o) < 0).any():
            raise _corrupt(folder, "doc_offsets.npy does not index tokens.bin document by document")
        if len(self.doc_domain) and not 0 <= self.doc_domain.min() <= self.doc_domain.max() < len(domains):
            raise _corrupt(folder, f"doc_domain.npy names domains outside the {len(domains)} of meta.json")
        self.tokens = np.memmap(folder / "tokens.bin", dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0)
        if vocab_size is not None:
            self._verify(vocab_size, content_hash)

    def scan(self) -> tuple[str, int]:
        """tokens.bin's xxh3-128 hash and its largest token id (-1 when empty), in one pass over the memory map."""
        h, top = xxhash.xxh3_128(), -1
        for start in range(0, len(self.tokens), SCAN_CHUNK):
            chunk = self.tokens[start : start + SCAN_CHUNK]
            h.update(chunk)
            top = max(top, int(chunk.max()))
        return h.hexdigest(), top

    def _verify(self, vocab_size: int, content_hash: str | None) -> None:
        # why once per file and process: a run loads a split more than once (training, the final summary, every
        # arm of an experiment); an edit changes the size or the modification time, and is scanned again
        st = (self._folder / "tokens.bin").stat()
        key = (str((self._folder / "tokens.bin").resolve()), st.st_size, st.st_mtime_ns, vocab_size, content_hash)
        if key in _verified:
            return
        digest, top = self.scan()
        if top >= vocab_size:
            raise _corrupt(
                self._folder, f"tokens.bin holds token id {top}, beyond the vocabulary of {vocab_size} in meta.json"
            )
        if content_hash is not None and digest != content_hash:
            raise _corrupt(
                self._folder, f"tokens.bin is not the file preparation wrote: its {HASH} hash differs from meta.json's"
            )
        _verified.add(key)

    @property
    def n_docs(self) -> int:
        return len(self.doc_domain)

    def doc_names(self) -> list[str]:
        return json.loads((self._folder / "doc_names.json").read_text())

    def document(self, d: int) -> np.ndarray:
        return self.tokens[self.doc_offsets[d] : self.doc_offsets[d + 1]]

    def domain_docs(self, domain: str) -> np.ndarray:
        return np.flatnonzero(self.doc_domain == self.domains.index(domain))


def _corrupt(folder: Path, why: str) -> DataError:
    return DataError(
        f"token shard {folder} is damaged ({why}); prepare the data again: "
        "moe-lm prepare --config <your config> --force"
    )
