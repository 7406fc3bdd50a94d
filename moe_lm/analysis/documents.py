"""The documents an analysis reads: the user's sources (`--data`: files, folders, parquet, hf:NAME, with their text
and domain fields) tokenized by the subject's own tokenizer, or the documents the subject brings (`Subject.documents`:
a moe-lm run's validation split with its domains, an engine's record's own sequences)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from moe_lm.analysis.subjects import Subject
from moe_lm.data.documents import ReadReport, check_domain_field
from moe_lm.data.sources import iter_source
from moe_lm.data.tokenizer import Tokenizer
from moe_lm.errors import UserError


@dataclass(frozen=True)
class Documents:
    """Which documents: `data` sources as in data.sources (empty: the documents the subject brings), the column (or
    .jsonl key) with the text, and the one naming the domain (absent: the source's name)."""

    data: tuple[str, ...] = ()
    text_field: str = "text"
    domain_field: str = "domain"


def user_documents(
    paths: list[str],
    tok: Tokenizer,
    domains: list[str],
    text_field: str,
    domain_field: str,
    max_tokens_per_domain: int | None = None,
) -> Iterator[tuple[int, np.ndarray]]:
    """(domain index, token ids) for every document of the user's sources; `domains` fills as names appear.
    A domain that has given `max_tokens_per_domain` tokens gives no more (its documents are read, not tokenized)."""
    report = ReadReport()
    given: dict[int, int] = {}
    for path in paths:
        for doc in iter_source(path, report, text_field, domain_field):
            if doc.domain not in domains:
                domains.append(doc.domain)
            d = domains.index(doc.domain)
            if max_tokens_per_domain is not None and given.get(d, 0) >= max_tokens_per_domain:
                continue
            ids = np.array([tok.doc_start_id, *tok.encode(doc.text)], dtype=np.int64)
            given[d] = given.get(d, 0) + len(ids)
            yield d, ids
    check_domain_field(report, domain_field, paths)
    print(report.summary(), file=sys.stderr)


def document_stream(
    subject: Subject, documents: Documents, max_tokens_per_domain: int | None = None
) -> tuple[Iterator[tuple[int, np.ndarray]], list[str], str]:
    """(domain index, token ids) of the documents, lazily; the domain names (for --data filled as the stream is read);
    and what they are, for the trace's provenance."""
    if documents.data:
        domains: list[str] = []
        stream = user_documents(list(documents.data), subject.tok, domains, documents.text_field,
                                documents.domain_field, max_tokens_per_domain)  # fmt: skip
        return stream, domains, ", ".join(documents.data)
    if subject.documents is None:  # the command line refuses it first: a kind without documents needs --data
        raise UserError("this subject has no documents of its own: give --data")
    stream, domains = subject.documents.read()
    return stream, domains, subject.documents.what
