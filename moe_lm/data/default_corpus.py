"""The embedded default corpus: five clearly different domains, shipped with the package so that every installation
trains on the same documents (`embedded/default_corpus.jsonl.xz`, about 1 MB; built once from a Python installation
by moe_lm/data/build_default_corpus.py, where its domains and sources are described; PSF and open-source licensed
text, whose license texts are the `license` domain).

The file is pinned by its sha256: a modified or truncated copy is refused, never silently read. Each domain is
capped at `max_mb_per_domain` megabytes in the shipped order (at most SHIPPED_MB_PER_DOMAIN, what the file holds).
"""

from __future__ import annotations

import hashlib
import json
import lzma
from collections.abc import Iterator
from pathlib import Path

from moe_lm.data.documents import Document, ReadReport
from moe_lm.errors import DataError

DOMAINS = ("python", "c", "docs", "readme", "license")
EMBEDDED = Path(__file__).with_name("embedded") / "default_corpus.jsonl.xz"
EMBEDDED_SHA256 = "8aa3980a2b534d8477751461846bba7463b63c16a7ddc0a528fb376d24900669"
SHIPPED_MB_PER_DOMAIN = 2.0


def iter_default_corpus(max_mb_per_domain: float, report: ReadReport) -> Iterator[Document]:
    if max_mb_per_domain > SHIPPED_MB_PER_DOMAIN:
        raise DataError(
            f"data.max_mb_per_domain={max_mb_per_domain}: the embedded corpus ships {SHIPPED_MB_PER_DOMAIN} MB per "
            "domain at most; lower it, or name more text in data.sources (docs/data.md)"
        )
    budget, used = int(max_mb_per_domain * 1e6), {}
    for doc in shipped_documents():
        size = len(doc["text"].encode("utf-8"))
        if used.get(doc["domain"], 0) >= budget:
            continue
        used[doc["domain"]] = used.get(doc["domain"], 0) + size
        report.documents[doc["domain"]] += 1
        yield Document(f"{doc['domain']}:{doc['name']}", doc["domain"], doc["text"])


def shipped_documents() -> list[dict]:
    """{domain, name, text} of every shipped document, in the shipped order, after checking the file's hash."""
    try:
        data = EMBEDDED.read_bytes()
    except OSError as e:
        raise DataError(f"{EMBEDDED}: the embedded corpus is missing ({e}); reinstall moe-lm") from None
    if hashlib.sha256(data).hexdigest() != EMBEDDED_SHA256:
        raise DataError(
            f"{EMBEDDED} is not the pinned embedded corpus (its sha256 differs from EMBEDDED_SHA256): reinstall "
            "moe-lm, or if you rebuilt it on purpose (make corpus), pin the new hash"
        )
    return [json.loads(line) for line in lzma.decompress(data).decode("utf-8").splitlines()]
