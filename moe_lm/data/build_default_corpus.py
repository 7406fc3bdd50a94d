"""Builds the embedded default corpus (moe_lm/data/embedded/default_corpus.jsonl.xz) from text a Python
installation carries. Run by a maintainer (`make corpus`), never by training: the shipped file is what every
installation reads, so that every installation trains on the same documents.

    python   the standard library's Python source            (code)
    c        the CPython C API headers                        (code, another language)
    docs     the language reference topics of pydoc_data       (English technical prose)
    readme   the long descriptions (METADATA) of moe-lm's dependencies, transitively   (Markdown/reST prose)
    license  the license texts of the interpreter and of those dependencies            (legal English)

Only moe-lm's own dependency tree is read (public PyPI packages under open licenses), not whatever else happens to
be installed; this project's own README is left out (it changes with every measurement recorded in it). Files are
visited in a fixed order (a hash of their path, so a cap per domain samples evenly instead of taking one package's
files) until `SHIPPED_MB_PER_DOMAIN` is reached.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import lzma
import re
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from moe_lm.data.default_corpus import EMBEDDED, SHIPPED_MB_PER_DOMAIN
from moe_lm.data.documents import ReadReport, read_text

ROOT_DISTRIBUTION = "moe-lm"
ROOT_EXTRAS = ("wandb", "tensorboard", "datasets", "analysis", "hf", "eval")  # "all", spelled out


def installed_corpus(report: ReadReport) -> Iterator[dict]:
    """{domain, name, text} of every document, domain by domain, each domain up to the shipped cap."""
    budget = int(SHIPPED_MB_PER_DOMAIN * 1e6)
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
            if text.strip():
                used += len(text.encode("utf-8"))
                yield {"domain": domain, "name": name, "text": text}


def write_embedded(path: Path = EMBEDDED) -> str:
    """Writes the corpus as xz-compressed JSON lines; returns its sha256 (to pin in default_corpus.py)."""
    report = ReadReport()
    lines = "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in installed_corpus(report))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(lzma.compress(lines.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))
    return hashlib.sha256(path.read_bytes()).hexdigest()


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


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(dist: importlib.metadata.Distribution, extras: tuple[str, ...] = ()) -> set[str]:
    """The distributions `dist` requires: unconditional ones, and those of the named extras."""
    names = set()
    for req in dist.requires or []:
        spec, _, marker = req.partition(";")
        wanted = re.findall(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
        if wanted and not set(map(_normal, wanted)) & set(extras):
            continue
        names.add(_normal(re.match(r"[A-Za-z0-9._-]+", spec.strip()).group()))
    return names


def dependency_tree() -> list[importlib.metadata.Distribution]:
    """moe-lm's installed dependencies (with every extra but dev), transitively, in a fixed hashed order."""
    root = importlib.metadata.distribution(ROOT_DISTRIBUTION)
    todo, seen = sorted(_requirement_names(root, ROOT_EXTRAS)), {}
    while todo:
        name = todo.pop()
        if name in seen or name == ROOT_DISTRIBUTION:
            continue
        try:
            seen[name] = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a platform-conditional requirement this installation does not have
        todo.extend(sorted(_requirement_names(seen[name]) - seen.keys()))
    return [seen[n] for n in sorted(seen, key=lambda n: hashlib.sha1(n.encode()).hexdigest())]


def _package_readmes() -> Iterator[tuple[str, str]]:
    for dist in dependency_tree():
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if isinstance(body, str):
            yield _normal(dist.metadata["Name"]), body


def _licenses(report: ReadReport) -> Iterator[tuple[str, str]]:
    stdlib_license = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if stdlib_license.is_file():
        yield "python/LICENSE.txt", read_text(stdlib_license, report)
    for dist in dependency_tree():
        for f in sorted(dist.files or [], key=str):
            upper = f.name.upper()
            if ("LICEN" in upper or "COPYING" in upper) and f.suffix.lower() in ("", ".txt", ".md", ".rst"):
                path = Path(f.locate())
                if path.is_file():
                    yield f"{_normal(dist.metadata['Name'])}/{f.name}", read_text(path, report)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else EMBEDDED
    print(f"wrote {out}: sha256 {write_embedded(out)} (pin it as EMBEDDED_SHA256 in moe_lm/data/default_corpus.py)")
