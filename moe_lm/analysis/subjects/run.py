"""A moe-lm run's checkpoint (`--run RUN[:TAG]`): its newest complete checkpoint or checkpoint TAG, its own tokenizer
and validation split (its documents when --data is not given), its untrained twin N1 (the same config at the run's
own initial weights), its shape (the model built on the meta device) and its weights for --attribute as they are."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_lm.analysis.subjects.base import (
    SEQ_LEN,
    Flag,
    PruneSource,
    Settings,
    SubjectKind,
    SubjectRequest,
    WeightsBuilder,
    register_subject_kind,
)
from moe_lm.analysis.subjects.loaded import OwnDocuments, Shape, Subject, TrainingRun
from moe_lm.checkpoint.format import RunRef, checkpoint_folder, load_model, parse_run
from moe_lm.config import Config, load_config
from moe_lm.data.prepare import load_split
from moe_lm.data.tokenizer import load_data_tokenizer
from moe_lm.model import initial_model
from moe_lm.routing.torch_routing import transformer_routing


@dataclass(frozen=True)
class RunSubject(SubjectRequest):
    kind = "run"
    run: RunRef

    @property
    def spec(self) -> str:
        run, tag = self.run
        return f"{run}:{tag}" if tag else str(run)


def run_config(request: RunSubject) -> Config:
    """The config of the checkpoint a request names, read alone (nothing else of the run is loaded)."""
    return load_config(checkpoint_folder(*request.run) / "config.yaml")


def validation_split(cfg: Config) -> OwnDocuments:
    """The run's validation split as its documents, with their domains."""

    def read():
        shard = load_split(cfg.data.out_dir, "val")
        stream = ((int(shard.doc_domain[d]), np.asarray(shard.document(d))) for d in range(shard.n_docs))
        return stream, list(shard.domains)

    return OwnDocuments(f"{cfg.data.out_dir} (validation split)", read)


class RunKind(SubjectKind):
    name, request = "run", RunSubject
    flag = Flag(("--run",), {"metavar": "RUN[:TAG]", "help": "a run folder (its newest complete checkpoint), or "
                             "RUN:TAG for checkpoint TAG"})  # fmt: skip
    looks_like = "a run folder (with checkpoints/; RUN:TAG for one of them)"
    needs_data, reroutable = False, True
    gives = frozenset({"weights", "margins", "logprob", "norms"})

    def from_flags(self, spec: str, settings: Settings) -> RunSubject:
        return RunSubject(run=parse_run(spec), seq_len=settings[SEQ_LEN])

    def recognises(self, spec: str) -> bool:
        return (parse_run(spec).run / "checkpoints").is_dir()

    def window_length(self, request: RunSubject) -> tuple[int, int | None]:
        cfg = run_config(request)
        return request.seq_len or cfg.train.seq_len, cfg.model.max_seq_len

    def load(self, request: RunSubject) -> Subject:
        run, tag = request.run
        cfg, model, tag = load_model(run, tag)
        length = min(request.seq_len or cfg.train.seq_len, cfg.model.max_seq_len)
        return Subject(
            transformer_routing(model), load_data_tokenizer(cfg.data.out_dir), length, cfg.model.vocab_size,
            {"run": str(run), "tag": tag}, untrained=lambda: transformer_routing(initial_model(cfg)),
            run=TrainingRun(run, cfg), documents=validation_split(cfg),
        )  # fmt: skip

    def shape(self, request: RunSubject) -> Shape:
        import torch

        from moe_lm.model import Transformer

        cfg = run_config(request)
        with torch.device("meta"):  # why: the layer numbering as the model has it, and nothing read but the config
            model = Transformer(cfg.model)
        layers = [i for i in model.moe_layer_ids() if i < cfg.model.n_layers]
        moe = cfg.model.moe
        return Shape(load_data_tokenizer(cfg.data.out_dir), cfg.model.vocab_size, cfg.model.n_layers, layers,
                     moe.n_routed_experts, moe.num_experts_per_tok, {"served": str(request.run.run)})  # fmt: skip

    def described(self, provenance: dict) -> str:
        return f"checkpoint {provenance.get('tag') or 'latest'}" if "run" in provenance else ""

    def prune_source(self, request: RunSubject) -> PruneSource:
        return PruneSource("run", request.run.run)

    def in_architecture(self, request: RunSubject, run: RunSubject) -> WeightsBuilder:
        return lambda cfg: load_model(*request.run)[1]


register_subject_kind(RunKind())
