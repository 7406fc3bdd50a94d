"""The embedded default corpus: five clearly different domains from text every Python installation carries.

    python   the standard library's Python source            (code)
    c        the CPython C API headers                        (code, another language)
    docs     the language reference topics of pydoc_data       (English technical prose)
    readme   installed packages' long descriptions (METADATA)  (Markdown/reST prose)
    license  license texts of the interpreter and packages     (legal English)

Deterministic for a given installation (this project's own package is left out, so editing our README does not
change the corpus): files are visited in a fixed order (a hash of their path, so a cap per
domain samples evenly instead of taking one package's files) until `max_mb_per_domain` is reached.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from moe_lm.data.documents import Document, ReadReport, read_text

DOMAINS = ("python", "c", "docs", "readme", "license")


def iter_default_corpus(max_mb_per_domain: float, report: ReadReport) -> Iterator[Document]:
    budget = int(max_mb_per_domain * 1e6)
    for domain, docs in (
        ("python", _stdlib_source(report)),
        ("c", _c_headers(report)),
        ("docs", _pydoc_topics()),
        ("readme", _package_readmes()),
        ("license", _licenses(report)),
    ):
        used = 0
        for name, text in docs:
            if used >= budget:
                break
            if not text.strip():
                continue
            used += len(text.encode("utf-8"))
            report.documents[domain] += 1
            yield Document(f"{domain}:{name}", domain, text)


def _ordered(paths: list[Path], root: Path) -> list[Path]:
    return sorted(paths, key=lambda p: hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest())


def _stdlib_source(report: ReadReport) -> Iterator[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    for p in _ordered(files, root):
        yield str(p.relative_to(root)), read_text(p, report)


def _c_headers(report: ReadReport) -> Iterator[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["include"])
    if not root.is_dir():
        return
    for p in _ordered(list(root.rglob("*.h")), root):
        yield str(p.relative_to(root)), read_text(p, report)


def _pydoc_topics() -> Iterator[tuple[str, str]]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield name, topics[name]


# why: our own README (this package's long description) changes with every measurement we record in it.
EXCLUDED_DISTRIBUTIONS = {"moe-lm"}


def _distributions() -> list[importlib.metadata.Distribution]:
    by_name = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower()
        if name and name not in by_name and name not in EXCLUDED_DISTRIBUTIONS:
            by_name[name] = dist
    return [by_name[n] for n in sorted(by_name, key=lambda n: hashlib.sha1(n.encode()).hexdigest())]


def _package_readmes() -> Iterator[tuple[str, str]]:
    for dist in _distributions():
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if isinstance(body, str):
            yield dist.metadata["Name"].lower(), body


def _licenses(report: ReadReport) -> Iterator[tuple[str, str]]:
    stdlib_license = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if stdlib_license.is_file():
        yield "python/LICENSE.txt", read_text(stdlib_license, report)
    for dist in _distributions():
        for f in sorted(dist.files or [], key=str):
            upper = f.name.upper()
            if ("LICEN" in upper or "COPYING" in upper) and f.suffix.lower() in ("", ".txt", ".md", ".rst"):
                path = Path(f.locate())
                if path.is_file():
                    yield f"{dist.metadata['Name'].lower()}/{f.name}", read_text(path, report)
