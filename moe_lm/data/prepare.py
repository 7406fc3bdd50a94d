"""Corpus -> document split -> tokenizer -> token shards, streamed, resumable, with a manifest.

Layout of a prepared data folder (`data.out_dir`):
    meta.json          domains, vocab size, token counts, and the settings it was built with (written last)
    manifest.json      sources, per-domain documents/bytes/tokens/hash, skips, and every document's name and split
    tokenizer.model    sentencepiece model (trained on the training split only)
    train/, val/       token shards (see shards.py)
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

from tqdm import tqdm

from moe_lm.config import DataConfig
from moe_lm.data.default_corpus import iter_default_corpus
from moe_lm.data.documents import DataError, Document, ReadReport, iter_source
from moe_lm.data.shards import ShardWriter, TokenShard
from moe_lm.data.tokenizer import BOS_ID, load_tokenizer, train_tokenizer

MIN_DEFAULT_DOMAINS = 4


def iter_documents(cfg: DataConfig, report: ReadReport) -> Iterator[Document]:
    for source in cfg.sources:
        if source == "default":
            yield from iter_default_corpus(cfg.max_mb_per_domain, report)
        else:
            yield from iter_source(source, report)


def is_validation(name: str, val_fraction: float) -> bool:
    """Stable split by document name: the same document is always on the same side."""
    return int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) / 2**32 < val_fraction


def build_signature(cfg: DataConfig, vocab_size: int, seed: int) -> dict:
    return {
        "sources": [s if s == "default" else str(Path(s).resolve()) for s in cfg.sources],
        "val_fraction": cfg.val_fraction,
        "max_mb_per_domain": cfg.max_mb_per_domain,
        "tokenizer_type": cfg.tokenizer_type,
        "vocab_size": vocab_size,
        "seed": seed,
    }


def prepare_data(
    cfg: DataConfig, vocab_size: int, seed: int = 0, force: bool = False, log: Callable[[str], None] = print
) -> Path:
    """Build the data folder if it is missing or `force`; returns its path."""
    out = Path(cfg.out_dir)
    signature = build_signature(cfg, vocab_size, seed)
    if (out / "meta.json").is_file() and not force:
        built = json.loads((out / "meta.json").read_text())["signature"]
        if built == signature:
            log(f"data in {out} is up to date (use --force to rebuild)")
            return out
        changed = ", ".join(k for k in signature if signature[k] != built.get(k))
        raise DataError(
            f"{out} was prepared with other settings ({changed}); rebuild it with --force or set data.out_dir elsewhere"
        )
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

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

    # Pass 2: tokenizer on the training split only.
    text_file = tmp / "tokenizer_train.txt"
    with open(text_file, "w", encoding="utf-8") as f:
        for doc in _read_docs(docs_file):
            if split_of[doc.name] == "train":
                f.write(doc.text if doc.text.endswith("\n") else doc.text + "\n")
    log(f"training a {cfg.tokenizer_type} tokenizer with {vocab_size} pieces ...")
    model_path = train_tokenizer(text_file, tmp / "tokenizer", vocab_size, cfg.tokenizer_type, seed)
    text_file.unlink()
    (tmp / "tokenizer.vocab").unlink(missing_ok=True)
    sp = load_tokenizer(model_path)

    # Pass 3: token shards.
    writers = {s: ShardWriter(tmp / s, vocab_size) for s in ("train", "val")}
    tokens = defaultdict(Counter)
    for doc in tqdm(_read_docs(docs_file), total=len(entries), desc="tokenizing", unit="doc", leave=False):
        ids = [BOS_ID, *sp.encode(doc.text)]
        split = split_of[doc.name]
        writers[split].add(ids, domains.index(doc.domain), doc.name)
        tokens[split][doc.domain] += len(ids)
    for w in writers.values():
        w.close()
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
        "vocab_size": vocab_size,
        "bos_id": BOS_ID,
        "tokens": {s: sum(tokens[s].values()) for s in ("train", "val")},
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log(f"prepared {out}: " + ", ".join(f"{s} {meta['tokens'][s]:,} tokens" for s in ("train", "val")))
    return out


def _read_docs(path: Path) -> Iterator[Document]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            obj = json.loads(line)
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
    for docs in by_domain.values():
        val = [e for e in docs if e["split"] == "val"]
        if len(docs) >= 2 and not val:
            min(docs, key=lambda e: e["sha256"])["split"] = "val"  # deterministic choice
        if len(docs) >= 2 and len(val) == len(docs):
            max(docs, key=lambda e: e["sha256"])["split"] = "train"
        if all(e["split"] == "val" for e in docs):
            docs[0]["split"] = "train"


def load_split(data_dir: str | Path, split: str) -> TokenShard:
    """The prepared `split` ("train" or "val") of a data folder."""
    data_dir = Path(data_dir)
    meta_path = data_dir / "meta.json"
    if not meta_path.is_file():
        raise DataError(f"no prepared data in {data_dir}: run `python launch/prepare_data.py --config <your config>`")
    meta = json.loads(meta_path.read_text())
    return TokenShard(data_dir / split, meta["domains"])
