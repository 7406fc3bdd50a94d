"""A moe-lm run's checkpoint (`--run RUN[:TAG]`): its newest complete checkpoint or checkpoint TAG, its own tokenizer
and validation split (its documents when --data is not given), and its untrained twin N1 (the same config at the
run's own initial weights)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_lm.analysis.subjects.base import Flag, Subject, SubjectKind, SubjectRequest, register_subject_kind
from moe_lm.checkpoint.format import RunRef, checkpoint_folder, load_model, parse_run
from moe_lm.config import load_config
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


class RunKind(SubjectKind):
    name, request = "run", RunSubject
    flag = Flag(("--run",), {"metavar": "RUN[:TAG]", "help": "a run folder (its newest complete checkpoint), or "
                             "RUN:TAG for checkpoint TAG"})  # fmt: skip
    looks_like = "a run folder (with checkpoints/; RUN:TAG for one of them)"
    needs_data, reroutable = False, True
    gives = frozenset({"weights", "margins", "logprob"})

    def from_flags(self, spec: str, args) -> RunSubject:
        return RunSubject(run=parse_run(spec), seq_len=args.seq_len)

    def recognises(self, spec: str) -> bool:
        return (parse_run(spec).run / "checkpoints").is_dir()

    def windows(self, request: RunSubject) -> tuple[int, int | None]:
        cfg = load_config(checkpoint_folder(*request.run) / "config.yaml")
        return request.seq_len or cfg.train.seq_len, cfg.model.max_seq_len

    def load(self, request: RunSubject) -> Subject:
        run, tag = request.run
        cfg, model, tag = load_model(run, tag)
        windows = min(request.seq_len or cfg.train.seq_len, cfg.model.max_seq_len)
        return Subject(
            transformer_routing(model), load_data_tokenizer(cfg.data.out_dir), windows, cfg.model.vocab_size,
            {"run": str(run), "tag": tag}, untrained=lambda: transformer_routing(initial_model(cfg)), run=run, cfg=cfg,
        )  # fmt: skip


register_subject_kind(RunKind())
