"""Load a run's checkpoint at another expert-parallel size (weights only): the logits on fixed tokens, on every
rank of a forked job (tests/helpers/ranks.py): `ranks(resharded_logits, 8, run, 8)`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from moe_lm.checkpoint import save_resume
from moe_lm.checkpoint.format import latest_tag
from moe_lm.config import load_config
from moe_lm.model import Transformer
from moe_lm.parallel.deepspeed_setup import build_engine
from moe_lm.parallel.expert_parallel import apply_expert_parallel


def fixed_tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 24), generator=torch.Generator().manual_seed(11))


def resharded_logits(run: Path, ep: int) -> torch.Tensor:
    """The logits of the run's latest checkpoint loaded into `ep`-way expert parallelism (this rank's batch: all)."""
    tag = latest_tag(run)
    cfg = load_config(run / "checkpoints" / tag / "config.yaml")
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep_size=ep))
    engine = build_engine(
        apply_expert_parallel(Transformer(cfg.model), ep), optim=cfg.optim, train=cfg.train, parallel=cfg.parallel
    )
    save_resume.load(engine, run, tag, load_optimizer_states=False)
    engine.eval()
    with torch.no_grad():
        return engine(fixed_tokens(cfg.model.vocab_size)).logits
