"""The bias update against the global counts, checked on every rank of a forked job (tests/helpers/ranks.py):
`ranks(bias_update_checks, 2, zero_stage)`.

Each rank routes different random tokens; after each optimizer step every rank must hold the bias
b + gamma * sign(mean(c) - c) computed from the counts SUMMED over all ranks, identical everywhere.
Returns {"ok": true, ...} (rank 0; None elsewhere) or raises.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_lm.config import Config, LoggingConfig, MLAConfig, ParallelConfig, TrainConfig
from moe_lm.model import Transformer
from moe_lm.parallel.deepspeed_setup import build_engine
from moe_lm.testing import tiny_model_cfg
from moe_lm.train.balance import balance_step


def bias_update_checks(zero: int) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    speed = 0.01
    cfg = Config(
        model=tiny_model_cfg(
            vocab_size=64,
            n_heads=2,
            inter_dim=64,
            max_seq_len=256,
            mla=MLAConfig(),
            moe=dict(
                num_experts_per_tok=2,
                n_group=1,
                topk_group=1,
                routed_scaling_factor=1.0,
                moe_inter_dim=16,
                bias_update_speed=speed,
            ),
        ),
        train=TrainConfig(micro_batch_size=2, grad_accum_steps=2, seq_len=16),
        parallel=ParallelConfig(zero_stage=zero),
        logging=LoggingConfig(wandb_mode="disabled"),
    )
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    engine = build_engine(model, optim=cfg.optim, train=cfg.train, parallel=cfg.parallel)
    gen = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    checks = 0
    for _ in range(3):
        for _ in range(cfg.train.grad_accum_steps):
            tokens = torch.randint(0, 64, (2, 17), generator=gen)
            out = engine(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten())
            engine.backward(loss + out.aux_loss)
            engine.step()
        local = torch.stack([r.tokens_per_expert.clone() for r in model.routers()])
        before = torch.stack([r.e_score_correction_bias.clone() for r in model.routers()])
        everyone = [torch.zeros_like(local) for _ in range(world)]
        dist.all_gather(everyone, local)
        total = torch.stack(everyone).sum(0).double()
        expected = before + speed * torch.sign(total.mean(-1, keepdim=True) - total).float()
        balance_step(model, speed)
        after = torch.stack([r.e_score_correction_bias for r in model.routers()])
        assert torch.allclose(after, expected, atol=1e-7), (rank, after, expected)
        assert all(r.tokens_per_expert.sum() == 0 for r in model.routers())
        biases = [torch.zeros_like(after) for _ in range(world)]
        dist.all_gather(biases, after)
        assert all(torch.equal(b, biases[0]) for b in biases), "biases differ between ranks"
        # the ranks really routed differently, so agreement is not a coincidence
        assert world == 1 or not all(torch.equal(e, everyone[0]) for e in everyone)
        checks += 1
    return {"ok": True, "world": world, "checks": checks, "zero": zero} if rank == 0 else None
