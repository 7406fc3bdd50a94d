"""Documents with a domain label, read from the user's files: .txt, .jsonl, or a folder per domain.

Every document keeps a stable `name` (its origin), which decides the train/validation split and lets analytics
point back at the source. A file's name is its path from the folder that holds the source (`corpus/law/a.txt`,
`corpus/law/b.jsonl:3`), not its absolute path: the same corpus moved to another folder or machine keeps its names,
its split and its data fingerprint. Bad input never disappears silently: unusable documents are counted in a
`ReadReport` with examples, and input that cannot be read at all is an error that says what to do.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from moe_lm.errors import DataError

TEXT_SUFFIXES = (".txt", ".jsonl")


@dataclass(frozen=True)
class Document:
    # stable: "<file>" or "<file>:<line>" (see source_name) or "<corpus>:<item>"; not always unique (two packages'
    # numpy/LICENSE.txt), which is harmless: the split is a function of the name, so both land on one side
    name: str
    domain: str
    text: str


@dataclass
class ReadReport:
    """What was read and what was skipped (with up to a few examples per reason)."""

    documents: Counter = field(default_factory=Counter)  # per domain
    skipped: Counter = field(default_factory=Counter)  # per reason
    examples: dict[str, list[str]] = field(default_factory=dict)
    repaired: int = 0  # documents whose undecodable bytes or lone surrogates were replaced by U+FFFD
    labelled: int = 0  # documents whose domain came from the domain field (the others: their file's or folder's)

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] += 1
        self.examples.setdefault(reason, [])
        if len(self.examples[reason]) < 3:
            self.examples[reason].append(where)

    def summary(self) -> str:
        lines = [
            f"read {sum(self.documents.values())} documents in {len(self.documents)} domains: "
            + ", ".join(f"{d}={n}" for d, n in sorted(self.documents.items()))
        ]
        if self.repaired:
            lines.append(f"  {self.repaired} documents had undecodable bytes or lone surrogates, replaced by U+FFFD")
        for reason, n in sorted(self.skipped.items()):
            lines.append(f"  skipped {n} ({reason}), e.g. {', '.join(self.examples[reason])}")
        return "\n".join(lines)


def read_text(path: Path, report: ReadReport) -> str:
    """UTF-8 text of a file; undecodable bytes are replaced and counted, not dropped."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        report.repaired += 1
        return raw.decode("utf-8", errors="replace")


def source_name(path: Path, source: Path) -> str:
    """The name of the documents of file `path` read from `source` (that file, or a folder above it): the path from
    the folder holding the source. why not the absolute path: it would move the split and the data fingerprint with
    the corpus's location; why the source's own name in it: two sources keep their files apart."""
    return Path(os.path.abspath(path)).relative_to(Path(os.path.abspath(source)).parent).as_posix()


def iter_file(
    path: Path,
    name: str,
    domain: str | None,
    report: ReadReport,
    text_field: str = "text",
    domain_field: str = "domain",
) -> Iterator[Document]:
    """Documents of one .txt (the whole file is one document, named `name`) or .jsonl file (one per line, named
    `name:<line>`); skips and errors give the path itself, for the user to find."""
    if path.suffix == ".txt":
        text = read_text(path, report)
        if not text.strip():
            report.skip("empty file", str(path))
            return
        yield Document(name, domain or path.stem, text)
        return
    if path.suffix != ".jsonl":
        raise DataError(f"{path}: unsupported file type (use .txt, .jsonl, or a folder of them)")
    # why split on "\n" only: str.splitlines also breaks at U+2028, U+2029, U+0085 and other separators, which a
    # JSON string may hold raw; a line is what JSON Lines (and wc -l) call one, and its number names the document
    for lineno, line in enumerate(read_text(path, report).split("\n"), start=1):
        where = f"{path}:{lineno}"
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            report.skip("invalid JSON line", where)
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
            report.skip(f"jsonl line without a string {text_field!r} field", where)
            continue
        if not obj[text_field].strip():
            report.skip("empty text", where)
            continue
        line_domain = obj.get(domain_field)
        report.labelled += line_domain is not None
        line_domain = str(line_domain) if line_domain is not None else (domain or path.stem)
        text = without_surrogates(obj[text_field], report)
        yield Document(f"{name}:{lineno}", without_surrogates(line_domain, report), text)


LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def without_surrogates(text: str, report: ReadReport) -> str:
    """`text` with lone surrogates (JSON's escaped `\\ud83d` without its pair: not a character, and not encodable
    as UTF-8) replaced by U+FFFD and counted as a repair, as undecodable bytes are."""
    if not LONE_SURROGATE.search(text):
        return text
    report.repaired += 1
    return LONE_SURROGATE.sub("\ufffd", text)


def iter_text_source(
    path: Path, report: ReadReport, text_field: str = "text", domain_field: str = "domain"
) -> Iterator[Document]:
    """Documents of a .txt/.jsonl file, a folder of them (one domain), or a folder of domain folders; each counted
    in `report.documents` by domain."""
    if path.is_file():
        yield from counted(iter_file(path, source_name(path, path), None, report, text_field, domain_field), report)
        return
    subdirs = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    # why abspath: a folder given as '.' has no name of its own
    groups = [(d.name, d) for d in subdirs] if subdirs else [(Path(os.path.abspath(path)).name, path)]
    if subdirs:  # a folder of domain folders: files beside them belong to no domain
        for stray in sorted(p for p in path.iterdir() if p.is_file() and p.suffix in TEXT_SUFFIXES):
            report.skip("file beside the domain folders (in no domain; move it into one)", str(stray))
    for domain, folder in groups:
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        n_before = sum(report.documents.values())
        for f in files:
            # a .jsonl line's own "domain" field wins over its folder
            yield from counted(iter_file(f, source_name(f, path), domain, report, text_field, domain_field), report)
        if sum(report.documents.values()) == n_before:
            raise DataError(f"domain folder {folder} holds no usable .txt/.jsonl documents; remove it or add text")


def text_files(path: Path) -> list[Path]:
    """The .txt/.jsonl files a text source (a file or a folder) may read, resolved."""
    path = path.resolve()
    # why every .txt/.jsonl below the folder (not only those read): a new file there is a change worth noticing
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES)


DEFAULT_DOMAIN_FIELD = "domain"


def check_domain_field(report: ReadReport, domain_field: str, sources: list) -> None:
    """A DataError when a domain field other than the default was asked for and no document had it: the domains would
    silently be the files' names (a misspelt column of MMLU-style data gives one domain)."""
    if domain_field != DEFAULT_DOMAIN_FIELD and report.labelled == 0 and sum(report.documents.values()):
        raise DataError(
            f"no document of {', '.join(map(str, sources))} has a {domain_field!r} field (the domain field asked for); "
            "name the column or .jsonl key that holds each document's domain, or leave it out to use the files' names"
        )


def counted(docs: Iterator[Document], report: ReadReport) -> Iterator[Document]:
    """The documents, each counted in `report.documents` by domain as it passes."""
    for doc in docs:
        report.documents[doc.domain] += 1
        yield doc
