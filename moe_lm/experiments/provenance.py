"""What an experiment's result depends on beyond its config: the data's content and the code's version.

A run's cache key, its final evaluation and the report carry both, so another installation (whose embedded corpus
reads other packages), a changed default or a new commit can never reuse a stale run, and a report never mixes runs
of different data or code.

- `data_fingerprint(data_dir)`: a hash of every document's name, domain, split and content hash, of the token
  shards, and of the tokenizer's pieces: the same text cut the same way, tokenized the same way.
- `training_code()`: a hash of the source a training run executes: the training command and every module of the
  packages it reaches (model, ops, data, train, parallel, checkpoint, routing, the research variants) and the C++
  kernels. It keys the run's folder, so
  editing a report, a figure or an experiment's description does not throw away hours of runs, while any change
  to the model, the data pipeline or the training loop trains again.
- `evaluation_code()`: the same for the final evaluation (moe_lm/experiments/final_eval.py and what it imports);
  a run evaluated by other evaluation code is evaluated again (seconds, not a retraining).
- `git_commit()`: the checkout's commit, for a reader (None outside a git checkout); not part of any key.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from moe_lm.errors import NotFound

PACKAGE = Path(__file__).resolve().parents[1]
# the training command and every package it reaches, walked whole (it imports some of them inside functions)
TRAINING_ENTRIES = ("moe_lm.cli.train", "moe_lm.train", "moe_lm.model", "moe_lm.ops", "moe_lm.data", "moe_lm.parallel",
                    "moe_lm.checkpoint", "moe_lm.routing", "moe_lm.experiments.variants")  # fmt: skip
EVALUATION_ENTRIES = (*TRAINING_ENTRIES, "moe_lm.experiments.final_eval")
# why a fresh interpreter: the modules this process happens to have imported are not the entry points'
_IMPORTED = """
import importlib, json, pkgutil, sys
for entry in sys.argv[1:]:
    module = importlib.import_module(entry)
    for sub in pkgutil.walk_packages(getattr(module, "__path__", []), entry + "."):
        importlib.import_module(sub.name)
print(json.dumps(sorted(m.__file__ for n, m in list(sys.modules.items())
                        if n.split(".")[0] == "moe_lm" and getattr(m, "__file__", None))))
"""


def data_fingerprint(data_dir: str | Path) -> str:
    """16 hex digits identifying a prepared data folder: every document's domain, name, split and content hash (the
    manifest), the token shards the runs read (tokens, document offsets and domains), and the tokenizer's pieces in
    id order with its BOS/EOS. why pieces and not the tokenizer file: a sentencepiece model stores the path of the
    text it was trained from, so two identical preparations differ in bytes there."""
    from moe_lm.data.tokenizer import load_data_tokenizer

    folder = Path(data_dir)
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        raise NotFound(f"{folder} has no manifest.json: prepare the data first (moe-lm prepare)")
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
def training_code() -> str:
    """16 hex digits identifying the source a training run executes."""
    return _source_hash(TRAINING_ENTRIES)


@functools.cache
def evaluation_code() -> str:
    """16 hex digits identifying the source the final evaluation executes."""
    return _source_hash(EVALUATION_ENTRIES)


def _source_hash(entries: tuple[str, ...]) -> str:
    out = subprocess.run([sys.executable, "-c", _IMPORTED, *entries], capture_output=True, text=True, check=True)
    # why the last line: the imports may print before it (DeepSpeed's accelerator notice, under MOE_LM_VERBOSE=1)
    files = {Path(f) for f in json.loads(out.stdout.splitlines()[-1])} | set((PACKAGE / "ops").rglob("*.cpp"))
    files |= set((PACKAGE / "ops").rglob("*.h"))
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PACKAGE, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
