"""The flags that name what the analytics study and on which documents; `moe-lm analyze` takes every kind of subject
(moe_lm/analysis/subjects/), `moe-lm ablate` the kinds whose routers can be routed around. Each kind declares its
flag and its settings flags; this module puts them on the command line and hands each kind the values of the flags it
declared (`Settings`), never the namespace."""

from __future__ import annotations

import argparse
import glob
from collections.abc import Sequence
from pathlib import Path

from moe_lm.analysis.documents import Documents
from moe_lm.analysis.subjects import KINDS, SEQ_LEN, Flag, Settings, SubjectKind, SubjectRequest, recognise, recognised
from moe_lm.errors import UserError
from moe_lm.flags import default_of


def all_kinds() -> list[SubjectKind]:
    return list(KINDS.values())


def reroutable_kinds() -> list[SubjectKind]:
    return [kind for kind in KINDS.values() if kind.reroutable]


def prunable_kinds() -> list[SubjectKind]:
    """The kinds `moe-lm prune` writes a pruned copy of (`SubjectKind.prune_source`)."""
    return [kind for kind in KINDS.values() if kind.prunable]


def settings_flags(kinds: list[SubjectKind]) -> list[Flag]:
    """Every settings flag of the kinds, once: --seq-len first, then each kind's, a flag two kinds share once."""
    return list(dict.fromkeys(flag for kind in kinds for flag in kind.flags()))


def add_subject(ap: argparse.ArgumentParser, kinds: list[SubjectKind]) -> None:
    """One flag per kind (exactly one of them given), each kind's settings, and the documents' and windows' flags."""
    what = ap.add_mutually_exclusive_group(required=True)
    for kind in kinds:
        what.add_argument(*kind.flag.names, **kind.flag.options)
    for flag in settings_flags(kinds):
        if flag is not SEQ_LEN:  # added with the windows' flags below
            ap.add_argument(*flag.names, **flag.options)
    ap.add_argument(
        "--data", nargs="*", metavar="SOURCE", help="sources as in data.sources: files, folders, parquet, hf:NAME "
        "(default with --run: its validation split)",
    )  # fmt: skip
    ap.add_argument("--text-field", default=default_of(Documents, "text_field"),
                    help="the column (or .jsonl key) with the text")  # fmt: skip
    ap.add_argument("--domain-field", default=default_of(Documents, "domain_field"),
                    help="the column naming the domain (absent: source name)")  # fmt: skip
    ap.add_argument(*SEQ_LEN.names, **SEQ_LEN.options)


def given_kind(args: argparse.Namespace, kinds: list[SubjectKind]) -> SubjectKind:
    """The kind whose flag the command line gave."""
    return next(kind for kind in kinds if vars(args)[kind.flag.dest] is not None)


def subject_request(args: argparse.Namespace, kinds: list[SubjectKind], settings: Settings) -> SubjectRequest:
    """The subject the flags name, as its kind's request."""
    kind = given_kind(args, kinds)
    return kind.from_flags(vars(args)[kind.flag.dest], settings.only(kind.flags()))


def compared_request(spec: str, kinds: list[SubjectKind], settings: Settings) -> SubjectRequest:
    """A --compare SUBJECT: the kind that recognises it (by what the file or folder is), with the same settings."""
    kind = recognise(spec, kinds)
    return kind.from_flags(spec, settings.only(kind.flags()))


def documents_request(args: argparse.Namespace) -> Documents:
    return Documents(tuple(args.data or ()), args.text_field, args.domain_field)


def check_subject(
    args: argparse.Namespace, kinds: list[SubjectKind], compare: Sequence[str] = (), documents_given: bool = False
) -> Settings:
    """The subject flags' combinations argparse cannot check itself, each kind checking its own settings (told
    whether the subject or a `compare` SUBJECT is of its kind); the settings the subjects run with.
    `documents_given`: the command has its documents from elsewhere (prune's --trace), --data is not needed."""
    kind = given_kind(args, kinds)
    if kind.needs_data and not args.data and not documents_given:
        raise UserError(f"{kind.flag.names[0]} needs --data (the documents to run it on, tokenized with its own "
                        "tokenizer)")  # fmt: skip
    if args.seq_len is not None and args.seq_len < 2:
        raise UserError(f"--seq-len must be at least 2 tokens (a token and the one it predicts), got {args.seq_len}")
    settings = Settings({flag: vars(args)[flag.dest] for flag in settings_flags(kinds)})
    used = {kind, *(recognised(spec, kinds) for spec in compare)}
    for each in kinds:
        settings = settings.replaced(each.check(settings.only(each.flags()), each in used))
    if kind.refuses_data and args.data:
        raise UserError(f"{kind.flag.names[0]} {vars(args)[kind.flag.dest]}: {kind.refuses_data}; leave out --data")
    missing = [p for p in args.data or [] if not (p.startswith("hf:") or glob.has_magic(p) or Path(p).exists())]
    if missing:
        raise UserError(f"--data: not found: {', '.join(missing)}")
    return settings
