"""The flags that name what the analytics study and on which documents; `moe-lm analyze` takes every kind of subject
(moe_lm/analysis/subjects/), `moe-lm ablate` the kinds whose routers can be routed around. Each kind declares its
flag and its settings; this module puts them on the command line and reads them back."""

from __future__ import annotations

import argparse
import glob
from pathlib import Path

from moe_lm.analysis.documents import Documents
from moe_lm.analysis.subjects import KINDS, SubjectKind, SubjectRequest, recognise
from moe_lm.errors import UserError
from moe_lm.flags import default_of


def all_kinds() -> list[SubjectKind]:
    return list(KINDS.values())


def reroutable_kinds() -> list[SubjectKind]:
    return [kind for kind in KINDS.values() if kind.reroutable]


def add_subject(ap: argparse.ArgumentParser, kinds: list[SubjectKind]) -> None:
    """One flag per kind (exactly one of them given), each kind's settings, and the documents' and windows' flags."""
    what = ap.add_mutually_exclusive_group(required=True)
    for kind in kinds:
        what.add_argument(*kind.flag.names, **kind.flag.options)
    for flag in {f.names: f for kind in kinds for f in kind.settings}.values():  # a setting two kinds share: once
        ap.add_argument(*flag.names, **flag.options)
    ap.add_argument(
        "--data", nargs="*", metavar="SOURCE", help="sources as in data.sources: files, folders, parquet, hf:NAME "
        "(default with --run: its validation split)",
    )  # fmt: skip
    ap.add_argument("--text-field", default=default_of(Documents, "text_field"),
                    help="the column (or .jsonl key) with the text")  # fmt: skip
    ap.add_argument("--domain-field", default=default_of(Documents, "domain_field"),
                    help="the column naming the domain (absent: source name)")  # fmt: skip
    ap.add_argument(
        "--seq-len", type=int, default=None, help="window length, the same for every subject of a comparison "
        "(default: a run's train.seq_len, else 1024; capped by every subject's context)",
    )  # fmt: skip


def given_kind(args: argparse.Namespace, kinds: list[SubjectKind]) -> SubjectKind:
    """The kind whose flag the command line gave."""
    return next(kind for kind in kinds if getattr(args, kind.flag.dest, None) is not None)


def subject_request(args: argparse.Namespace, kinds: list[SubjectKind]) -> SubjectRequest:
    """The subject the flags name, as its kind's request."""
    kind = given_kind(args, kinds)
    return kind.from_flags(getattr(args, kind.flag.dest), args)


def compared_request(spec: str, args: argparse.Namespace, kinds: list[SubjectKind]) -> SubjectRequest:
    """A --compare SUBJECT: the kind that recognises it (by what the file or folder is), with the same settings."""
    return recognise(spec, kinds).from_flags(spec, args)


def documents_request(args: argparse.Namespace) -> Documents:
    return Documents(tuple(args.data or ()), args.text_field, args.domain_field)


def check_subject(args: argparse.Namespace, kinds: list[SubjectKind]) -> None:
    """The subject flags' combinations argparse cannot check itself; each kind checks its own settings."""
    kind = given_kind(args, kinds)
    if kind.needs_data and not args.data:
        raise UserError(f"{kind.flag.names[0]} needs --data (the documents to run it on, tokenized with its own "
                        "tokenizer)")  # fmt: skip
    if args.seq_len is not None and args.seq_len < 2:
        raise UserError(f"--seq-len must be at least 2 tokens (a token and the one it predicts), got {args.seq_len}")
    for each in kinds:
        each.check(args)
    missing = [p for p in args.data or [] if not (p.startswith("hf:") or glob.has_magic(p) or Path(p).exists())]
    if missing:
        raise UserError(f"--data: not found: {', '.join(missing)}")
