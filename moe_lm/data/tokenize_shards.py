"""Pass 3 of preparation: the document stream -> token shards, in one process or in N worker processes.

The stream (documents.jsonl: one {"name", "domain", "text"} per line, in corpus order) is cut into N contiguous
byte ranges at line boundaries. Worker i tokenizes its range into shards of its own, one document in memory at a
time (a long one encoded and written in chunks); the parts are then joined in range order, so N workers write the
same bytes as one. Workers are spawned, not forked: preparation may run inside a training process whose threads a
fork would copy mid-flight.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np

from moe_lm.data.shards import ShardWriter
from moe_lm.data.tokenizer import load_data_tokenizer

SPLITS = ("train", "val")


def tokenize_to_shards(
    docs_file: Path, split_of: dict[str, str], domains: list[str], tok_dir: Path, out: Path, workers: int = 1
) -> dict[str, Counter]:
    """Write out/train and out/val from the stream with the tokenizer in `tok_dir`; tokens per split and domain."""
    ranges = _line_ranges(docs_file, workers)
    if len(ranges) == 1:
        return _tokenize_range(docs_file, *ranges[0], split_of, domains, tok_dir, out)
    parts = [out / f"part{i}" for i in range(len(ranges))]
    jobs = [(docs_file, a, b, split_of, domains, tok_dir, part) for (a, b), part in zip(ranges, parts, strict=True)]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the processes are the parallelism
    with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
        counts = pool.starmap(_tokenize_range, jobs)
    for split in SPLITS:
        _join([part / split for part in parts], out / split)
    for part in parts:
        shutil.rmtree(part)
    return {s: sum((c[s] for c in counts), Counter()) for s in SPLITS}


def _line_ranges(path: Path, n: int) -> list[tuple[int, int]]:
    """Up to n contiguous byte ranges of `path` that start and end at line boundaries."""
    size = path.stat().st_size
    bounds = [0]
    with open(path, "rb") as f:
        for i in range(1, max(n, 1)):
            f.seek(max(size * i // n, bounds[-1]))
            if f.tell() > 0:
                f.readline()  # to the start of the next line
            bounds.append(min(f.tell(), size))
    bounds.append(size)
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a] or [(0, 0)]


def _tokenize_range(docs_file, start, end, split_of, domains, tok_dir, out) -> dict[str, Counter]:
    tok = load_data_tokenizer(tok_dir)
    writers = {s: ShardWriter(Path(out) / s, tok.vocab_size) for s in SPLITS}
    tokens = {s: Counter() for s in SPLITS}
    with open(docs_file, "rb") as f:
        f.seek(start)
        while f.tell() < end:
            doc = json.loads(f.readline())
            # a long document in chunks (SentencePieceTokenizer.encode_chunks): no encode call and no list of ids
            # ever holds the whole of it
            ids = itertools.chain([[tok.doc_start_id]], tok.encode_chunks(doc["text"]))
            split = split_of[doc["name"]]
            n = writers[split].add(ids, domains.index(doc["domain"]), doc["name"])
            tokens[split][doc["domain"]] += n
    for w in writers.values():
        w.close()
    return tokens


def _join(parts: list[Path], out: Path) -> None:
    """Concatenate shard folders (same token dtype) in order into one."""
    out.mkdir(parents=True, exist_ok=True)
    offsets, domain, names, total = [np.zeros(1, np.int64)], [], [], 0
    with open(out / "tokens.bin", "wb") as dst:
        for part in parts:
            with open(part / "tokens.bin", "rb") as src:
                shutil.copyfileobj(src, dst, 16 << 20)
            part_offsets = np.load(part / "doc_offsets.npy")
            offsets.append(part_offsets[1:] + total)
            total += int(part_offsets[-1])
            domain.append(np.load(part / "doc_domain.npy"))
            names += json.loads((part / "doc_names.json").read_text())
    first = json.loads((parts[0] / "shard.json").read_text())
    np.save(out / "doc_offsets.npy", np.concatenate(offsets))
    np.save(out / "doc_domain.npy", np.concatenate(domain))
    (out / "doc_names.json").write_text(json.dumps(names))
    (out / "shard.json").write_text(json.dumps({"dtype": first["dtype"], "n_tokens": total}))
