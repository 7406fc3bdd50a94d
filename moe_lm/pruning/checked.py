"""The model `moe-lm prune --check` prunes, whatever its kind, giving the check the same things: its routing (`shape`,
the MoE layers), its held-out documents, the loaded subject (the unpruned model, its tokenizer, its own calibration
documents) and, per plan, the pruned model, each as a TorchRouting.

    run            each pruned model built in memory (pruned.py); held out: the run's validation split
    transformers   each pruned model written by prune's transformers writer into a scratch folder and loaded back
                   by transformers (what is scored is what `moe-lm prune --hf` writes); held out: --held-out-data

Either can be given --held-out-data instead of its own held-out documents (a run's tokenizer tokenizes them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from moe_lm.analysis.budget import budget_documents
from moe_lm.analysis.documents import Documents, document_stream
from moe_lm.analysis.subjects import SubjectRequest, kind_of, load_subject
from moe_lm.analysis.subjects.loaded import OwnDocuments, Subject
from moe_lm.analysis.subjects.run import run_config, validation_split
from moe_lm.checkpoint.format import load_model
from moe_lm.data.prepare import load_split
from moe_lm.data.tokenizer import load_data_tokenizer
from moe_lm.errors import DataError, UserError
from moe_lm.pruning.formats import SafetensorsFormat
from moe_lm.pruning.hf_folder import prune_hf_folder
from moe_lm.pruning.plan import KeepPlan, RoutingShape
from moe_lm.pruning.pruned import pruned_model
from moe_lm.pruning.run import check_source, routing_shape
from moe_lm.routing.torch_routing import TorchRouting, transformer_routing

HeldOut = tuple[list[tuple[int, np.ndarray]], list[str], str]  # (documents, domain names, what they are)


class CheckedModel(ABC):
    """A subject the check prunes: `shape` and `label` read without weights at construction; `load()` the rest."""

    shape: RoutingShape
    label: str
    subject: Subject | None = None

    @abstractmethod
    def about(self) -> dict:
        """What the model is, for check.json."""

    @abstractmethod
    def own_held_out(self, max_tokens: int) -> HeldOut:
        """Its own held-out documents under `max_tokens` (equal shares per domain); a UserError where it has none."""

    @abstractmethod
    def load(self) -> Subject:
        """The unpruned model held in memory (its routing a TorchRouting) with its tokenizer and own documents."""

    @abstractmethod
    def pruned(self, plan: KeepPlan) -> contextlib.AbstractContextManager[TorchRouting]:
        """The model `plan` prunes, for the length of the block."""

    def held_out(self, documents: Documents, max_tokens: int) -> HeldOut:
        """The held-out documents: `documents` (--held-out-data) tokenized by the model's tokenizer (after `load()`),
        else its own."""
        if not documents.data:
            return self.own_held_out(max_tokens)
        stream, domains, what = document_stream(self.subject, documents, max_tokens)
        return _budgeted(stream, domains, what, max_tokens)


class RunChecked(CheckedModel):
    def __init__(self, request, out: Path) -> None:
        self.request, self.label, self.tag = request, request.label, request.run.tag
        self.cfg = run_config(request)
        check_source(self.cfg, request.label)
        self.shape = routing_shape(self.cfg)

    def about(self) -> dict:
        return {"run": str(self.request.run.run), "tag": self.tag}

    def own_held_out(self, max_tokens: int) -> HeldOut:
        split = validation_split(self.cfg)
        try:
            stream, domains = split.read()
            return _budgeted(stream, domains, split.what, max_tokens)
        except (DataError, OSError) as e:
            raise UserError(
                f"no held-out documents: the validation split of {self.cfg.data.out_dir} cannot be read ({e})"
            ) from None

    def load(self) -> Subject:
        run, tag = self.request.run
        self.cfg, self.model, self.tag = load_model(run, tag)
        self.model.eval()
        seq_len = min(self.request.seq_len or self.cfg.train.seq_len, self.cfg.model.max_seq_len)
        self.subject = Subject(transformer_routing(self.model), load_data_tokenizer(self.cfg.data.out_dir), seq_len,
                               self.cfg.model.vocab_size, self.about(), documents=training_split(self.cfg))  # fmt: skip
        return self.subject

    @contextlib.contextmanager
    def pruned(self, plan: KeepPlan) -> Iterator[TorchRouting]:
        yield transformer_routing(pruned_model(self.model, self.cfg, plan))


class HFChecked(CheckedModel):
    def __init__(self, request, out: Path) -> None:
        self.request, self.label, self.out = request, request.label, out
        self.format = SafetensorsFormat(request, Path(request.path))  # the types whose pruned copy is exact
        self.shape = self.format.shape

    def about(self) -> dict:
        return {"hf": str(self.request.path)}

    def own_held_out(self, max_tokens: int) -> HeldOut:
        raise UserError(f"--check of {self.label}: a transformers folder brings no held-out text; give "
                        "--held-out-data (documents the calibration --data does not hold)")  # fmt: skip

    def load(self) -> Subject:
        self.subject = held_in_memory(load_subject(self.request), self.label)
        return self.subject

    @contextlib.contextmanager
    def pruned(self, plan: KeepPlan) -> Iterator[TorchRouting]:
        ungroup = plan.n_group != self.shape.n_group
        # why written and read back: the check scores the folder `prune --hf` writes, in transformers; in the check's
        # own output folder, removed after the arm
        with tempfile.TemporaryDirectory(dir=self.out, prefix=".pruned-") as scratch:
            folder = Path(scratch) / "pruned"
            prune_hf_folder(self.format.source, folder, plan.with_untraced(self.format.layers).kept, ungroup=ungroup)
            with contextlib.redirect_stdout(io.StringIO()):  # why: its size line, per arm, names the scratch folder
                pruned = load_subject(dataclasses.replace(self.request, path=str(folder)))
            yield held_in_memory(pruned, self.label).routing


CHECKED = {"run": RunChecked, "transformers": HFChecked}  # by the format the subject's kind prunes into


def checked_model(request: SubjectRequest, out: Path) -> CheckedModel:
    """The CheckedModel of `request` (its scratch files in `out`, the check's folder), read without weights; a
    UserError for a format the check does not run."""
    source = kind_of(request).prune_source(request)
    if source.format not in CHECKED:
        raise UserError(f"--check runs each pruned model: give a moe-lm run (--run) or a transformers folder (--hf); "
                        f"{request.label} is pruned as {source.format}, which is written, not checked (prune it with "
                        "--sparsity or --keep and --criterion)")  # fmt: skip
    return CHECKED[source.format](request, out)


def held_in_memory(subject: Subject, label: str) -> Subject:
    """`subject`, whose model the check must run whole: a UserError for one streamed from disk a layer at a time."""
    if subject.routing.reroutable() is None:
        raise UserError(f"--check of {label}: it is run a layer at a time (streamed from disk), and the check runs "
                        "each pruned model whole: give a --max-memory it fits in")  # fmt: skip
    return subject


def training_split(cfg) -> OwnDocuments:
    """The run's training split, with its domains: the calibration documents unless --data or --trace is given."""

    def read():
        shard = load_split(cfg.data.out_dir, "train")
        stream = ((int(shard.doc_domain[d]), np.asarray(shard.document(d))) for d in range(shard.n_docs))
        return stream, list(shard.domains)

    return OwnDocuments(f"{cfg.data.out_dir} (training split)", read)


def _budgeted(stream, domains: list[str], what: str, max_tokens: int) -> HeldOut:
    """`stream`'s documents under `max_tokens` (equal shares per domain), those with a token to predict; a UserError
    when none is left."""
    docs, _ = budget_documents(stream, domains, max_tokens)
    docs = [(d, tokens) for d, tokens in docs if len(tokens) > 1]
    if not docs:
        raise UserError(f"no held-out documents: {what} holds no document of two tokens or more (a run: prepare "
                        "the data with a val_fraction above 0)")  # fmt: skip
    return docs, domains, what
