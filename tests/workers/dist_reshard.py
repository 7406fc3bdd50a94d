"""Load a run's checkpoint at another expert-parallel size (weights only) and write the logits on fixed tokens.

deepspeed --num_gpus N tests/workers/dist_reshard.py --run RUN --ep EP --out logits.pt
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from moe_lm.checkpoint import save_resume
from moe_lm.checkpoint.format import latest_tag
from moe_lm.config import load_config
from moe_lm.model import Transformer
from moe_lm.parallel.deepspeed_setup import build_engine
from moe_lm.parallel.expert_parallel import apply_expert_parallel
from tests.helpers.distributed import run_worker


def fixed_tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 24), generator=torch.Generator().manual_seed(11))


def main(args: argparse.Namespace) -> None:
    run = Path(args.run)
    tag = latest_tag(run)
    cfg = load_config(run / "checkpoints" / tag / "config.yaml")
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep_size=args.ep))
    engine = build_engine(apply_expert_parallel(Transformer(cfg.model), args.ep), cfg)
    save_resume.load(engine, run, tag, load_optimizer_states=False)
    engine.eval()
    with torch.no_grad():
        logits = engine(fixed_tokens(cfg.model.vocab_size)).logits
    if dist.get_rank() == 0:
        torch.save(logits, args.out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--ep", type=int, required=True)
    ap.add_argument("--out", required=True)
    run_worker(main, ap)
