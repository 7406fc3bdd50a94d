"""What an experiment's result depends on beyond its config: the data's content and the code's version.

A run's cache key, its final evaluation and the report carry both, so another installation (whose embedded corpus
reads other packages), a changed default or a new commit can never reuse a stale run, and a report never mixes runs
of different data or code.

- `data_fingerprint(data_dir)`: a hash of every document's name, domain, split and content hash, of the token
  shards, and of the tokenizer's pieces: the same text cut the same way, tokenized the same way.
- `code_version()`: a hash of the package's source (Python, C++ kernels, presets and experiment definitions).
- `git_commit()`: the checkout's commit, for a reader (None outside a git checkout); not part of any key.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".yaml")


def data_fingerprint(data_dir: str | Path) -> str:
    """16 hex digits identifying a prepared data folder: every document's domain, name, split and content hash (the
    manifest), the token shards the runs read (tokens, document offsets and domains), and the tokenizer's pieces in
    id order with its BOS/EOS. why pieces and not the tokenizer file: a sentencepiece model stores the path of the
    text it was trained from, so two identical preparations differ in bytes there."""
    from moe_lm.data.tokenizer import load_data_tokenizer

    folder = Path(data_dir)
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(f"{folder} has no manifest.json: prepare the data first (moe-lm prepare)")
    h = hashlib.sha256()
    for d in sorted(json.loads(manifest.read_text())["documents"], key=lambda d: (d["domain"], d["name"])):
        h.update(f"{d['domain']}\t{d['name']}\t{d['split']}\t{d['sha256']}\n".encode())
    for split in ("train", "val"):
        for path in sorted((folder / split).glob("*")):
            h.update(f"{split}/{path.name}".encode() + b"\0" + path.read_bytes())
    tok = load_data_tokenizer(folder)
    h.update(json.dumps([tok.bos_id, tok.eos_id, [tok.id_to_piece(i) for i in range(tok.vocab_size)]]).encode())
    return h.hexdigest()[:16]


@functools.cache
def code_version() -> str:
    """16 hex digits identifying the installed package's source."""
    h = hashlib.sha256()
    for path in sorted(p for p in PACKAGE.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()):
        h.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PACKAGE, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
