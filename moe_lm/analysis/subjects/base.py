"""What every kind of subject is: a request naming one (`SubjectRequest`, one dataclass per kind), what loading it
gives (`Subject`), and the kind itself (`SubjectKind`: its flags, how `--compare` recognises it, what it gives, how
it loads), kept in a registry as masks, objectives and architectures are."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from moe_lm.config import Config
from moe_lm.data.tokenizer import Tokenizer
from moe_lm.errors import UserError
from moe_lm.routing.routed_model import RoutedModel

DEFAULT_WINDOWS = 1024  # the windows of a released model when neither --seq-len nor a run's train.seq_len says


@dataclass(frozen=True, kw_only=True)
class SubjectRequest:
    """What is studied; each kind adds what names it and its own settings. `seq_len`: the window length (None: the
    kind's own; `moe-lm analyze` cuts every subject of a comparison into the same windows); `name`: how a report
    names it (default: how the user named it, `spec`)."""

    kind: ClassVar[str]
    seq_len: int | None = None
    name: str | None = None

    @property
    def spec(self) -> str:
        """How the user named it on the command line (a path, RUN:TAG)."""
        raise NotImplementedError

    @property
    def label(self) -> str:
        """How the subject is named in a report."""
        return self.name or self.spec


@dataclass
class Subject:
    """A loaded subject: what routes its tokens (`routing`, moe_lm/routing/routed_model.py), its tokenizer, the
    window length it is cut into, its vocabulary's size (subjects compared must have the same), what it is
    (`provenance`, kept in its trace), and how to build its untrained twin (N1; None, with the reason, where there is
    none). A moe-lm run also brings its folder and config (its validation split, metrics and wandb run)."""

    routing: RoutedModel
    tok: Tokenizer
    seq_len: int
    vocab_size: int
    provenance: dict
    untrained: Callable[[], RoutedModel] | None = None
    no_untrained: str = ""
    run: Path | None = None
    cfg: Config | None = None
    documents: tuple[list[tuple[int, np.ndarray]], list[str]] | None = None  # its own: (domain, ids) and domain names


@dataclass(frozen=True)
class Flag:
    """A command-line flag a kind declares: its names and argparse's keywords (the command line adds it)."""

    names: tuple[str, ...]
    options: dict = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")


class SubjectKind(ABC):
    """A kind of subject. Declares: `name` (its request's `kind`), `request` (its SubjectRequest dataclass), `flag`
    (the command-line flag naming one, e.g. `--gguf FILE`), `settings` (flags of its own, e.g. llama.cpp's threads),
    `needs_data` (no documents of its own: `--data` is required), `reroutable` (its routing is a PyTorch model's,
    whose routers `moe-lm ablate` can route around), `gives` (what its traces hold besides the experts), `looks_like`
    (what --compare recognises, in a few words)."""

    name: str
    request: type[SubjectRequest]
    flag: Flag
    looks_like: str
    settings: tuple[Flag, ...] = ()
    needs_data: bool = True
    reroutable: bool = False
    gives: frozenset[str] = frozenset()

    @abstractmethod
    def from_flags(self, spec: str, args) -> SubjectRequest:
        """The request for `spec` (the flag's value, or a --compare SUBJECT) with the settings flags in `args`."""

    @abstractmethod
    def recognises(self, spec: str) -> bool:
        """Whether a --compare SUBJECT names one of this kind (by what the file or folder is, never by its name)."""

    def check(self, args) -> None:  # noqa: B027 - a kind without settings has nothing to check
        """A UserError for settings flags `args` holds that this kind cannot use."""

    @abstractmethod
    def windows(self, request: SubjectRequest) -> tuple[int, int | None]:
        """(the window length it is cut into alone, the longest window it takes or None), read without loading
        weights."""

    @abstractmethod
    def load(self, request: SubjectRequest) -> Subject:
        """The subject, loaded; a project error (UserError, DataError, ...) naming what cannot be."""


KINDS: dict[str, SubjectKind] = {}


def register_subject_kind(kind: SubjectKind) -> SubjectKind:
    """Add a kind of subject (its name unique); the command line, --compare and the recorder then take it."""
    if kind.name in KINDS:
        raise ValueError(f"a subject kind named {kind.name!r} is registered already")
    KINDS[kind.name] = kind
    return kind


def kind_of(request: SubjectRequest) -> SubjectKind:
    return KINDS[request.kind]


def recognise(spec: str, kinds: list[SubjectKind]) -> SubjectKind:
    """The kind a --compare SUBJECT names, or a UserError listing what a subject can be."""
    found = [kind for kind in kinds if kind.recognises(spec)]
    if not found:
        what = [kind.looks_like for kind in kinds]
        listed = ", ".join(what[:-1]) + f" or {what[-1]}" if len(what) > 1 else what[0]
        raise UserError(f"--compare {spec}: not {listed}")
    return found[0]


def load_subject(request: SubjectRequest) -> Subject:
    """The Subject a request names, loaded by its kind; a folder or file that cannot be read is one UserError."""
    try:
        return kind_of(request).load(request)
    except OSError as e:  # a folder transformers cannot read, a file that went away: the user's to fix
        raise UserError(str(e)) from None


def windows_of(request: SubjectRequest) -> tuple[int, int | None]:
    """`SubjectKind.windows` of the request's kind; what cannot be read is left to `load_subject` to report."""
    try:
        return kind_of(request).windows(request)
    except Exception:  # noqa: BLE001 - load_subject reads it again and names what is wrong
        return request.seq_len or DEFAULT_WINDOWS, None
