"""What a kind of subject gives (base.py): a loaded `Subject` with its named optional parts (`OwnDocuments`, the
`TrainingRun` it is a checkpoint of), and a subject's `Shape`, read without its weights."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_lm.config import Config
from moe_lm.data.tokenizer import Tokenizer
from moe_lm.routing.routed_model import RoutedModel


@dataclass(frozen=True)
class OwnDocuments:
    """The documents a subject brings, read when no --data is given: a run's validation split, an engine's record's
    own sequences. `read()` -> ((domain index, token ids) per document, lazily; the domain names); `what`: where they
    come from, for the traces' provenance."""

    what: str
    read: Callable[[], tuple[Iterator[tuple[int, np.ndarray]], list[str]]]


@dataclass(frozen=True)
class TrainingRun:
    """The moe-lm run a subject is a checkpoint of: its folder (metrics.jsonl, the load over training; its wandb
    run) and the checkpoint's config."""

    folder: Path
    cfg: Config


@dataclass
class Subject:
    """A loaded subject: what routes its tokens (`routing`, moe_lm/routing/routed_model.py), its tokenizer, the
    window length it is cut into, its vocabulary's size (subjects compared must have the same), what it is
    (`provenance`, kept in its trace), and how to build its untrained twin (N1; None, with the reason, where there is
    none). Its optional parts: the documents it brings (`documents`), the moe-lm run it is a checkpoint of (`run`)."""

    routing: RoutedModel
    tok: Tokenizer
    seq_len: int
    vocab_size: int
    provenance: dict
    untrained: Callable[[], RoutedModel] | None = None
    no_untrained: str = ""
    run: TrainingRun | None = None
    documents: OwnDocuments | None = None


@dataclass
class Shape:
    """A subject's shape, read without its weights: its tokenizer and vocabulary size, its decoder layers (the
    engines' layer axis), its MoE layer ids in its own numbering, routed experts per MoE layer, experts chosen per
    token, and how a record served by it names it (`provenance`)."""

    tok: Tokenizer
    vocab_size: int
    n_layers: int
    layers: list[int]
    n_experts: int
    k: int
    provenance: dict
