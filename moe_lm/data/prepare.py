"""Corpus -> document split -> tokenizer -> token shards, streamed, resumable, with a manifest.

Layout of a prepared data folder (`data.out_dir`):
    meta.json          domains, vocab size, token counts, each split's tokens.bin hash, and the signature it was
                       built with (written last)
    manifest.json      sources, per-domain documents/bytes/tokens/hash, skips, and every document's name and split
    tokenizer.model    sentencepiece model (trained on the training split only, or the user's), or
    tokenizer/         the user's Hugging Face tokenizer (see tokenizer.py)
    train/, val/       token shards (see shards.py)

The folder is built whole beside out_dir (`.<name>.partial-<host>-<pid>/`) and renamed into place at the end
(moe_lm/output_folder.py). Nothing else is ever deleted: an out_dir that overlaps a source, or holds files this
project did not write, is refused; a failed or interrupted build removes its own partial folder (which holds a
copy of the corpus) and nothing more; a second prepare into the same folder is refused while the first runs.

A training run holds a shared flock on meta.json for as long as it reads the folder (`DataReadLock`); preparing the
folder again takes the exclusive lock first, so it is refused while a run reads the data, and a run does not start
on a folder being prepared again.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

from tqdm import tqdm

from moe_lm.compat import old_form
from moe_lm.config import DataConfig
from moe_lm.data.default_corpus import iter_default_corpus
from moe_lm.data.documents import Document, ReadReport, check_domain_field
from moe_lm.data.shards import TokenShard
from moe_lm.data.sources import iter_source, source_files
from moe_lm.data.tokenize_shards import tokenize_to_shards
from moe_lm.data.tokenizer import SentencePieceTokenizer, import_tokenizer, train_tokenizer, write_training_text
from moe_lm.errors import DataError
from moe_lm.files import some
from moe_lm.output_folder import MARKER, OutputFolder

MIN_DEFAULT_DOMAINS = 4
# What a finished data folder holds; anything else in out_dir is the user's, and is never deleted.
OUTPUTS = {"meta.json", "manifest.json", "tokenizer.model", "tokenizer", "train", "val", MARKER}


def iter_documents(cfg: DataConfig, report: ReadReport) -> Iterator[Document]:
    for source in cfg.sources:
        if source == "default":
            yield from iter_default_corpus(cfg.max_mb_per_domain, report)
        else:
            yield from iter_source(source, report, cfg.text_field, cfg.domain_field)
    check_domain_field(report, cfg.domain_field, cfg.sources)


def is_validation(name: str, val_fraction: float) -> bool:
    """Stable split by document name: the same document is always on the same side."""
    return int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) / 2**32 < val_fraction


def build_signature(cfg: DataConfig, vocab_size: int, seed: int) -> dict:
    """What the prepared folder depends on: sources (and a fingerprint of their files), settings, vocabulary."""
    return {
        "sources": [s if s == "default" else str(Path(s).resolve()) for s in cfg.sources],
        "source_files": sources_fingerprint(cfg.sources),
        "val_fraction": cfg.val_fraction,
        "max_mb_per_domain": cfg.max_mb_per_domain,
        "tokenizer": cfg.tokenizer if cfg.tokenizer == "train" else str(Path(cfg.tokenizer).resolve()),
        "tokenizer_type": cfg.tokenizer_type if cfg.tokenizer == "train" else None,
        # why not for a given tokenizer: its vocabulary is its own; model.vocab_size only has to hold it
        "vocab_size": vocab_size if cfg.tokenizer == "train" else None,
        "seed": seed,
    }


def sources_fingerprint(sources: list[str]) -> str | None:
    """A hash of every source file's path, size and modification time, and of hf: names (None for the embedded
    corpus alone).

    why not the contents: a stat per file is cheap enough to check at every training start, even for a large
    corpus; an edit changes the size or the modification time.
    """
    files = []
    for source in sources:
        if source == "default":
            continue
        if source.startswith("hf:"):
            files.append(source)  # a hub dataset cannot be stat'ed: its name stands for it
        for f in source_files(source):
            st = f.stat()
            files.append(f"{f}\t{st.st_size}\t{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(files).encode()).hexdigest() if files else None


def signature_changes(built: dict, wanted: dict, ignore: tuple[str, ...] = ()) -> list[str]:
    """The signature keys whose values differ (but those in `ignore`), worded for an error message."""
    names = {"source_files": "the source files' contents"}
    return [names.get(k, k) for k in wanted if k not in ignore and wanted[k] != built.get(k)]


def check_out_dir(cfg: DataConfig) -> None:
    """Refuse an out_dir whose replacement could destroy user data: one that is, contains or lies inside a
    source, or that holds files other than a data folder's own."""
    out = Path(cfg.out_dir).resolve()
    for source in cfg.sources:
        if source == "default" or source.startswith("hf:"):
            continue
        src = (Path(source).parent if glob.has_magic(source) else Path(source)).resolve()
        if out == src or out in src.parents or src in out.parents:
            raise DataError(
                f"data.out_dir={cfg.out_dir} overlaps the source {source}; preparing would overwrite the corpus. "
                "Set data.out_dir to a folder of its own (e.g. data/<name>)"
            )
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in OUTPUTS)
        if foreign:
            raise DataError(
                f"data.out_dir={cfg.out_dir} holds files that are not prepared data ({some(foreign)}); nothing there "
                "was deleted. Pick an empty or new folder"
            )


def prepare_data(
    cfg: DataConfig,
    vocab_size: int,
    seed: int = 0,
    force: bool = False,
    log: Callable[[str], None] = print,
    workers: int = 1,
) -> Path:
    """Build the data folder if it is missing or `force` (tokenizing in `workers` processes); returns its path."""
    out = Path(cfg.out_dir)
    check_out_dir(cfg)
    signature = build_signature(cfg, vocab_size, seed)
    if (out / "meta.json").is_file() and not force:
        built = read_meta(out)["signature"]
        if built == signature:
            log(f"data in {out} is up to date (use --force to rebuild)")
            return out
        raise DataError(
            f"{out} was prepared with other settings or sources ({', '.join(signature_changes(built, signature))}); "
            "rebuild it with --force or set data.out_dir elsewhere"
        )
    # why a folder written whole: a failed or interrupted build (it holds a copy of the corpus) leaves nothing, and
    # a second prepare into the same folder is refused while this one runs (moe_lm/output_folder.py)
    with _not_read(out), OutputFolder(out, "prepare", flag="data.out_dir=", say=log).staged() as tmp:
        _build(cfg, vocab_size, seed, signature, tmp, log, workers)
    meta = read_meta(out)
    log(f"prepared {out}: " + ", ".join(f"{s} {meta['tokens'][s]:,} tokens" for s in ("train", "val")))
    return out


class DataReadLock:
    """A shared flock on `data_dir`/meta.json, taken at once and held until closed (or the `with` block ends): a
    run's data cannot be prepared again under it (`prepare_data` takes the exclusive lock first)."""

    def __init__(self, data_dir: str | Path) -> None:
        meta = Path(data_dir) / "meta.json"
        self.fd = None
        if not meta.is_file():
            return  # nothing prepared: nothing to hold (reading it is an error that names the prepare command)
        self.fd = os.open(meta, os.O_RDONLY | os.O_NONBLOCK)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            raise DataError(
                f"data.out_dir={data_dir} is being prepared again by another process; wait for it to finish, then "
                "start the run (a run would record data that is about to change)"
            ) from None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> DataReadLock:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _not_read:  # noqa: N801 - used as a `with` clause
    """The exclusive flock on an existing data folder's meta.json for the life of a rebuild: refused while a
    training run reads the folder (it holds the shared lock)."""

    def __init__(self, out: Path) -> None:
        self.out, self.fd = out, None

    def __enter__(self):
        meta = self.out / "meta.json"
        if not meta.is_file():
            return self
        self.fd = os.open(meta, os.O_RDONLY | os.O_NONBLOCK)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise DataError(
                f"data.out_dir={self.out} is read by a running training (or being prepared by another process); "
                "preparing it again would change the data under that run. Wait for the run to end, or prepare into "
                "another data.out_dir (nothing was changed)"
            ) from None
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)


def _build(cfg: DataConfig, vocab_size: int, seed: int, signature: dict, tmp: Path, log, workers: int) -> None:
    """The three passes, writing into `tmp`; meta.json last."""
    # Pass 1: read every source once into a local document stream; hash, dedupe, split.
    report = ReadReport()
    docs_file = tmp / "documents.jsonl"
    entries = []
    seen = set()
    with open(docs_file, "w", encoding="utf-8") as f:
        for doc in tqdm(iter_documents(cfg, report), desc="reading documents", unit="doc", leave=False):
            digest = hashlib.sha256(doc.text.encode("utf-8", errors="surrogatepass")).hexdigest()
            if digest in seen:
                report.skip("duplicate document", doc.name)
                report.documents[doc.domain] -= 1
                continue
            seen.add(digest)
            split = "val" if is_validation(doc.name, cfg.val_fraction) else "train"
            entries.append(
                {"name": doc.name, "domain": doc.domain, "split": split, "bytes": len(doc.text), "sha256": digest[:16]}
            )
            f.write(json.dumps({"name": doc.name, "domain": doc.domain, "text": doc.text}) + "\n")
    log(report.summary())
    _check_and_balance_split(entries, cfg)
    domains = sorted({e["domain"] for e in entries})
    split_of = {e["name"]: e["split"] for e in entries}

    # Pass 2: the tokenizer, trained on the training split only, or the user's.
    tok = _tokenizer(cfg, docs_file, split_of, vocab_size, seed, tmp, log)

    # Pass 3: token shards; every document starts with the tokenizer's BOS (or, without one, its EOS).
    log(f"tokenizing {len(entries):,} documents" + (f" in {workers} processes" if workers > 1 else "") + " ...")
    tokens = tokenize_to_shards(docs_file, split_of, domains, tmp, tmp, workers)
    docs_file.unlink()

    per_domain = {
        d: {
            "documents": {s: sum(1 for e in entries if e["domain"] == d and e["split"] == s) for s in ("train", "val")},
            "bytes": sum(e["bytes"] for e in entries if e["domain"] == d),
            "tokens": {s: tokens[s][d] for s in ("train", "val")},
            "sha256": hashlib.sha256("".join(e["sha256"] for e in entries if e["domain"] == d).encode()).hexdigest(),
        }
        for d in domains
    }
    manifest = {
        "signature": signature,
        "domains": per_domain,
        "skipped": dict(report.skipped),
        "skipped_examples": report.examples,
        "repaired_documents": report.repaired,
        "documents": entries,
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    meta = {
        "signature": signature,
        "domains": domains,
        "vocab_size": tok.vocab_size,
        "bos_id": tok.doc_start_id,
        "tokenizer": {"kind": tok.kind, "source": cfg.tokenizer, "bos_id": tok.bos_id, "eos_id": tok.eos_id},
        "tokens": {s: sum(tokens[s].values()) for s in ("train", "val")},
        # each split's tokens.bin hash, checked whenever a process first reads it (TokenShard; docs/data.md)
        "tokens_xxh3_128": {s: TokenShard(tmp / s, domains).scan()[0] for s in ("train", "val")},
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))


def _tokenizer(cfg: DataConfig, docs_file: Path, split_of: dict, vocab_size: int, seed: int, tmp: Path, log):
    """Pass 2: train a sentencepiece tokenizer of `vocab_size` pieces on the training split, or import the user's
    (whose vocabulary must fit in model.vocab_size)."""
    if cfg.tokenizer != "train":
        tok = import_tokenizer(cfg.tokenizer, tmp)
        if tok.vocab_size > vocab_size:
            raise DataError(
                f"data.tokenizer={cfg.tokenizer} has {tok.vocab_size} tokens but model.vocab_size={vocab_size}: set "
                f"model.vocab_size={tok.vocab_size} (or larger)"
            )
        tok.doc_start_id  # noqa: B018 - a tokenizer without BOS and EOS is an error now, not after the corpus
        log(f"tokenizing with {cfg.tokenizer} ({tok.kind}, {tok.vocab_size} tokens)")
        return tok
    text_file = tmp / "tokenizer_train.txt"
    train_texts = (doc.text for doc in _read_docs(docs_file) if split_of[doc.name] == "train")
    log(write_training_text(train_texts, text_file))
    log(f"training a {cfg.tokenizer_type} tokenizer with {vocab_size} pieces ...")
    model_path = train_tokenizer(text_file, tmp / "tokenizer", vocab_size, cfg.tokenizer_type, seed)
    text_file.unlink()
    (tmp / "tokenizer.vocab").unlink(missing_ok=True)
    return SentencePieceTokenizer(model_path)


def _read_docs(path: Path) -> Iterator[Document]:
    with open(path, "rb") as f:
        for line in f:
            obj = json.loads(line)
            del line  # not kept beside the document while it is used: a long one is large
            yield Document(obj["name"], obj["domain"], obj["text"])


def _check_and_balance_split(entries: list[dict], cfg: DataConfig) -> None:
    """Every domain needs training text; each domain with 2+ documents also gets at least one for validation."""
    if not entries:
        raise DataError(f"no usable documents in data.sources={cfg.sources}")
    by_domain = defaultdict(list)
    for e in entries:
        by_domain[e["domain"]].append(e)
    if cfg.sources == ["default"] and len(by_domain) < MIN_DEFAULT_DOMAINS:
        raise DataError(
            f"the default corpus found only {len(by_domain)} domains ({', '.join(sorted(by_domain))}) in this Python "
            f"installation; at least {MIN_DEFAULT_DOMAINS} are needed: point data.sources at your own text instead"
        )
    by_name = defaultdict(list)
    for e in entries:
        by_name[e["name"]].append(e)

    def move(entry: dict, split: str) -> None:
        # why every document of the name: the later passes look a document's split up by its name
        for same in by_name[entry["name"]]:
            same["split"] = split

    for docs in by_domain.values():
        val = [e for e in docs if e["split"] == "val"]
        if len(docs) >= 2 and not val:
            move(min(docs, key=lambda e: e["sha256"]), "val")  # deterministic choice
        if len(docs) >= 2 and len(val) == len(docs):
            move(max(docs, key=lambda e: e["sha256"]), "train")
        if all(e["split"] == "val" for e in docs):
            move(docs[0], "train")


# meta.json's fields a reader relies on, with their types (tokens: {"train": int, "val": int})
META_FIELDS = {"signature": dict, "domains": list, "vocab_size": int, "tokens": dict, "bos_id": int}


def read_meta(data_dir: str | Path) -> dict:
    """meta.json of a prepared data folder, or a DataError that names the file and what to do."""
    meta_path = Path(data_dir) / "meta.json"
    if not meta_path.is_file():
        raise DataError(f"no prepared data in {data_dir}: run `moe-lm prepare --config <your config>`")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(
            f"{meta_path} is corrupt ({type(e).__name__}: {e}); prepare the data again: "
            "moe-lm prepare --config <your config> --force"
        ) from None
    if problem := _meta_problem(meta):
        raise DataError(
            f"{meta_path} is corrupt ({problem}); prepare the data again: moe-lm prepare --config <your config> --force"
        )
    return meta


def _meta_problem(meta) -> str | None:
    """What is wrong with a meta.json's fields (a missing key, a value of the wrong type), or None."""
    if not isinstance(meta, dict):
        return f"a JSON {type(meta).__name__}, not an object"
    for key, kind in META_FIELDS.items():
        if key not in meta and key != "bos_id":  # bos_id: folders from before it was recorded
            return f"no {key!r}"
        if key in meta and (not isinstance(meta[key], kind) or isinstance(meta[key], bool)):
            return f"{key!r} is a {type(meta[key]).__name__}, not a {kind.__name__}"
    if not all(isinstance(d, str) for d in meta["domains"]) or not meta["domains"]:
        return "'domains' is not a list of names"
    if not all(isinstance(meta["tokens"].get(s), int) for s in ("train", "val")):
        return "'tokens' does not count the train and val splits"
    hashes = meta.get("tokens_xxh3_128")
    if hashes is not None and not (isinstance(hashes, dict) and all(isinstance(h, str) for h in hashes.values())):
        return "'tokens_xxh3_128' is not a mapping of hashes"
    return None


def load_split(data_dir: str | Path, split: str) -> TokenShard:
    """The prepared `split` ("train" or "val") of a data folder, its token ids checked against the vocabulary and
    tokens.bin against the hash meta.json records (folders prepared before the hashes: the ids only)."""
    meta = read_meta(data_dir)
    hashes = meta.get("tokens_xxh3_128") or {}
    if not hashes or "bos_id" not in meta:
        old_form(f"{Path(data_dir) / 'meta.json'} (no token hashes)", "prepare the data again: moe-lm prepare --force")
    return TokenShard(Path(data_dir) / split, meta["domains"], meta["vocab_size"], hashes.get(split))
