"""What every kind of subject is: a request naming one (`SubjectRequest`, one dataclass per kind), the flags it
declares (`Flag`) and their values (`Settings`), and the kind itself (`SubjectKind`), kept in a registry as masks,
objectives and architectures are. A kind answers every question about its subjects; each optional capability is a
named hook whose default says "not this kind" (torchtitan's ModelSpec, OLMo-core's Callback), so that no caller asks
a subject what class it is. What loading gives (`Subject`, `Shape`): loaded.py."""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

from moe_lm.analysis.subjects.loaded import Shape, Subject
from moe_lm.errors import UserError

if TYPE_CHECKING:
    from torch import nn

    from moe_lm.config import ModelConfig

T = TypeVar("T")
DEFAULT_WINDOW_LENGTH = 1024  # a released model's window length when neither --seq-len nor a run's train.seq_len says


@dataclass(frozen=True, eq=False)
class Flag(Generic[T]):
    """A command-line flag a kind declares: its names and argparse's keywords (the command line adds it). A flag two
    kinds share is one object (compared by identity): the command line adds it once, and each kind reads it."""

    names: tuple[str, ...]
    options: dict = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")

    @property
    def default(self) -> T:
        """What the command line gives when the flag is left out (argparse's own answer, its type applied)."""
        parser = argparse.ArgumentParser()
        parser.add_argument(*self.names, **self.options)
        return vars(parser.parse_args([]))[self.dest]


SEQ_LEN: Flag[int | None] = Flag(("--seq-len",), {"type": int, "default": None, "help": "window length, the same for "
                                 "every subject of a comparison (default: a run's train.seq_len, else 1024; capped by "
                                 "every subject's context)"})  # fmt: skip


class Settings:
    """The values of settings flags, by flag: what a kind's `from_flags` and `check` are handed, holding the flags the
    kind declared (and --seq-len, every kind's) and no other: never the command line's namespace."""

    def __init__(self, values: Mapping[Flag, object]) -> None:
        self._values = dict(values)

    @classmethod
    def defaults(cls, flags: Iterable[Flag]) -> Settings:
        """Each flag at what the command line gives when it is left out."""
        return cls({flag: flag.default for flag in flags})

    def __getitem__(self, flag: Flag[T]) -> T:
        if flag not in self._values:
            raise KeyError(f"{flag.names[0]} is not a flag of these settings (a kind reads the flags it declares)")
        return self._values[flag]  # type: ignore[return-value]

    def only(self, flags: Iterable[Flag]) -> Settings:
        return Settings({flag: self[flag] for flag in flags})

    def replaced(self, other: Settings) -> Settings:
        """These settings with `other`'s values where it has them."""
        return Settings({**self._values, **other._values})


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


@dataclass(frozen=True)
class PruneSource:
    """What `moe-lm prune` writes a pruned copy of (`SubjectKind.prune_source`): `path`, the folder or file it reads
    (never written), and `format`, the writer moe_lm/pruning/formats.py takes it to: "run" (a moe-lm run's
    checkpoint), "transformers" (a DeepSeek-V3-layout safetensors folder), "fp8-release" (DeepSeek's FP8 blocks) or
    "gguf" (a GGUF file). A format, not a kind: one kind may give several (a transformers folder or an FP8 release)."""

    format: str
    path: Path


class NotInArchitecture(Exception):
    """Why a subject's weights do not run in a run's architecture (`SubjectKind.in_architecture`): its drift from the
    run cannot be split into weights and routing."""


WeightsBuilder = Callable[["ModelConfig"], "nn.Module"]  # the run's ModelConfig -> the other weights as our Transformer


class SubjectKind(ABC):
    """A kind of subject. Declares: `name` (its request's `kind`), `request` (its SubjectRequest dataclass), `flag`
    (the command-line flag naming one, e.g. `--gguf FILE`), `settings` (flags of its own, e.g. llama.cpp's threads),
    `needs_data` (no documents of its own: `--data` is required), `refuses_data` (why `--data` is refused, for a
    kind that routes only its own documents; empty: taken), `reroutable` (its routing is a PyTorch model's, whose
    routers `moe-lm ablate` can route around), `gives` (what its traces hold besides the experts; a folder streamed
    from disk, all of it but the output norms), `looks_like`
    (what --compare recognises, in a few words). Its hooks say the rest; those with a default are optional."""

    name: str
    request: type[SubjectRequest]
    flag: Flag
    looks_like: str
    settings: tuple[Flag, ...] = ()
    needs_data: bool = True
    refuses_data: str = ""
    reroutable: bool = False
    gives: frozenset[str] = frozenset()

    def flags(self) -> tuple[Flag, ...]:
        """The settings flags its requests are made from: --seq-len and its own."""
        return (SEQ_LEN, *self.settings)

    @abstractmethod
    def from_flags(self, spec: str, settings: Settings) -> SubjectRequest:
        """The request for `spec` (the flag's value, or a --compare SUBJECT) with the values of its flags."""

    @abstractmethod
    def recognises(self, spec: str) -> bool:
        """Whether a --compare SUBJECT names one of this kind (by what the file or folder is, never by its name)."""

    @abstractmethod
    def window_length(self, request: SubjectRequest) -> tuple[int, int | None]:
        """(the window length it is cut into alone, the longest window it takes or None), read without loading
        weights."""

    @abstractmethod
    def load(self, request: SubjectRequest) -> Subject:
        """The subject, loaded; a project error (UserError, DataError, ...) naming what cannot be."""

    def check(self, settings: Settings, used: bool) -> Settings:
        """Its settings checked before anything runs (`used`: a subject of the command is of this kind), a UserError
        for what it cannot use, and the settings it runs with (the same, unless it adjusts one)."""
        return settings

    def shape(self, request: SubjectRequest) -> Shape | None:
        """Its layers, experts, top-k, decoder layers, tokenizer and vocabulary, read without its weights: what an
        engine's record needs of the model it served (`--served`). None: this kind names no such model."""
        return None

    def in_architecture(self, request: SubjectRequest, run: SubjectRequest) -> WeightsBuilder:
        """A builder of its weights as the architecture of `run` (a RunSubject: our Transformer), for `--attribute`'s
        split of its drift; NotInArchitecture, saying why, where its weights do not run there."""
        raise NotInArchitecture("its weights do not run in the run's architecture: a moe-lm checkpoint, a DeepseekV3 "
                                "transformers folder or a GGUF file of the run's shape do")  # fmt: skip

    def prune_source(self, request: SubjectRequest) -> PruneSource:
        """What `moe-lm prune` reads and the format it writes the pruned copy in, read without loading weights; a
        UserError where this kind cannot be pruned (the default)."""
        raise UserError(f"{self.flag.names[0]} {request.spec}: moe-lm prune cannot prune {self.looks_like}")

    @property
    def prunable(self) -> bool:
        """Whether `moe-lm prune` takes this kind (it answers `prune_source`)."""
        return type(self).prune_source is not SubjectKind.prune_source

    def described(self, provenance: dict) -> str:
        """How a report names a subject of this kind from the provenance its `load` gave (what comparisons.md says a
        compared subject is); empty: not one of this kind, or nothing to say."""
        return ""

    def for_analysis(self, request: SubjectRequest, work: Path | None, last_layer: int | None) -> SubjectRequest:
        """The request as `moe-lm analyze` runs it: `work`, where it may keep work that a later run resumes (None: a
        temporary folder), and `last_layer`, the last MoE layer the analysis draws (None: all). Unchanged by
        default: only a subject streamed from disk keeps work or stops early."""
        return request


KINDS: dict[str, SubjectKind] = {}


def register_subject_kind(kind: SubjectKind) -> SubjectKind:
    """Add a kind of subject (its name unique); the command line, --compare and the recorder then take it."""
    if kind.name in KINDS:
        raise ValueError(f"a subject kind named {kind.name!r} is registered already")
    KINDS[kind.name] = kind
    return kind


def kind_of(request: SubjectRequest) -> SubjectKind:
    return KINDS[request.kind]


def what_they_are(kinds: Iterable[SubjectKind]) -> str:
    """What the kinds look like, listed ("a, b or c"): what a --compare SUBJECT can be."""
    what = [kind.looks_like for kind in kinds]
    return ", ".join(what[:-1]) + f" or {what[-1]}" if len(what) > 1 else what[0]


def described(provenance: dict) -> str:
    """What a subject is, from its trace's provenance, as the first kind that knows it says (empty: none does)."""
    return next((said for kind in KINDS.values() if (said := kind.described(provenance))), "")


def recognised(spec: str, kinds: Iterable[SubjectKind]) -> SubjectKind | None:
    """The first kind that recognises a SUBJECT (by what the file or folder is), or None."""
    return next((kind for kind in kinds if kind.recognises(spec)), None)


def recognise(spec: str, kinds: list[SubjectKind]) -> SubjectKind:
    """The kind a --compare SUBJECT names, or a UserError listing what a subject can be."""
    kind = recognised(spec, kinds)
    if kind is None:
        raise UserError(f"--compare {spec}: not {what_they_are(kinds)}")
    return kind


def load_subject(request: SubjectRequest) -> Subject:
    """The Subject a request names, loaded by its kind; a folder or file that cannot be read is one UserError."""
    try:
        return kind_of(request).load(request)
    except OSError as e:  # a folder transformers cannot read, a file that went away: the user's to fix
        raise UserError(str(e)) from None


def window_length_of(request: SubjectRequest) -> tuple[int, int | None]:
    """`SubjectKind.window_length` of the request's kind; what cannot be read is left to `load_subject` to report."""
    try:
        return kind_of(request).window_length(request)
    except Exception:  # noqa: BLE001 - load_subject reads it again and names what is wrong
        return request.seq_len or DEFAULT_WINDOW_LENGTH, None


def served_shape(spec: str) -> Shape:
    """The shape of the model SPEC names, as an engine's record needs it (`--served`): the first kind that recognises
    it and gives one, its flags at their defaults (a shape is read without running the model); a UserError else."""
    kinds = list(KINDS.values())
    kind = recognised(spec, kinds)
    if kind is None:
        raise UserError(f"--served {spec}: not {what_they_are(kinds)}")
    shape = kind.shape(kind.from_flags(spec, Settings.defaults(kind.flags())))
    if shape is None:
        raise UserError(f"--served {spec}: {kind.looks_like} names no model (its layers, experts and tokenizer)")
    return shape
