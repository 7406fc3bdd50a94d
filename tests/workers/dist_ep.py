"""Run under `deepspeed --num_gpus N`: expert-parallel training steps against a single-process reference.

Every rank builds the same model; the reference (all experts, no DeepSpeed) runs the whole global batch with
torch AdamW and clipping, the EP model runs this rank's share under DeepSpeed. Compared after each of two steps:
logits of this rank's sequences, the gradient norm, and every parameter (experts against their global slice).
Also checks the dispatcher's bookkeeping. Rank 0 writes the largest differences to --out.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_lm.config import Config, LoggingConfig, MLAConfig, MTPConfig, OptimConfig, ParallelConfig, TrainConfig
from moe_lm.model import Transformer
from moe_lm.parallel.deepspeed_setup import build_engine, param_groups
from moe_lm.parallel.expert_parallel import apply_expert_parallel, dispatchers, ensure_groups
from moe_lm.train.objective import next_token_losses, total_loss
from tests.helpers.distributed import run_worker
from tests.helpers.tiny import tiny_model_cfg

MICRO, SEQ, VOCAB = 2, 12, 64


def main(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = Config(
        model=tiny_model_cfg(
            vocab_size=VOCAB,
            n_heads=2,
            inter_dim=64,
            max_seq_len=SEQ,
            mla=MLAConfig(),
            moe=dict(routed_scaling_factor=1.0, moe_inter_dim=16, seq_aux_alpha=1e-2, bias_update_speed=0.0),
            mtp=MTPConfig(depth=args.mtp),
        ),
        # eps 1e-6, not 1e-8: where a gradient element is ~1e-8, Adam's update g/(|g|+eps) turns fp32 rounding
        # differences (an expert's rows summed in another order) into ~1e-5 parameter differences, which would
        # swamp the 1e-5 comparison below; 1e-6 keeps Adam well-conditioned there.
        optim=OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=0.05, weight_decay=0.1, eps=1e-6),
        train=TrainConfig(micro_batch_size=MICRO, grad_accum_steps=1, seq_len=SEQ),
        parallel=ParallelConfig(zero_stage=args.zero, ep_size=args.ep),
        logging=LoggingConfig(wandb_mode="disabled"),
    )
    torch.manual_seed(0)
    full = Transformer(cfg.model)
    reference = copy.deepcopy(full).train()
    o = cfg.optim
    ref_opt = torch.optim.AdamW(param_groups(reference, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    engine = build_engine(apply_expert_parallel(full, args.ep), cfg)
    model = engine.module
    ep_rank = dist.get_rank(group=ensure_groups(args.ep))
    n_local = cfg.model.moe.n_routed_experts // args.ep
    gen = torch.Generator().manual_seed(7)
    worst = {"logits": 0.0, "grad_norm_rel": 0.0, "params": 0.0}
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (world * MICRO, SEQ + 1), generator=gen)
        mine = tokens[rank * MICRO : (rank + 1) * MICRO]
        out = engine(mine[:, :-1], mtp=True)
        engine.backward(total_loss(*next_token_losses(out, mine[:, 1:]), 0.3, out.aux_loss))
        engine.step()
        ref_out = reference(tokens[:, :-1], mtp=True)
        # the reference written out: the global batch's mean CE per head, L_MTP = (0.3 / D) sum_k CE_k
        ref_loss = F.cross_entropy(ref_out.logits.flatten(0, 1), tokens[:, 1:].flatten()) + ref_out.aux_loss
        for k, logits in enumerate(ref_out.mtp_logits, start=1):
            ref_loss = ref_loss + 0.3 / args.mtp * F.cross_entropy(logits.flatten(0, 1), tokens[:, 1 + k :].flatten())
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), o.grad_clip).item()
        ref_opt.step()
        ref_opt.zero_grad()
        mine_ref = ref_out.logits[rank * MICRO : (rank + 1) * MICRO]
        worst["logits"] = max(worst["logits"], (out.logits - mine_ref).abs().max().item())
        worst["grad_norm_rel"] = max(worst["grad_norm_rel"], abs(engine.get_global_grad_norm() / ref_norm - 1))
        ref_params = dict(reference.named_parameters())
        keep = slice(ep_rank * n_local, (ep_rank + 1) * n_local)
        for name, p in model.named_parameters():
            if ".deepspeed_moe.experts." in name:
                plain = name.replace("deepspeed_moe.experts.", "")
                expected = ref_params[plain][keep]
            else:
                expected = ref_params[name]
            worst["params"] = max(worst["params"], (p.detach() - expected.detach()).abs().max().item())
    # dispatcher bookkeeping over the last step's forward: conservation and the once-per-rank send
    stats = torch.tensor(
        [[d.stats[k] for k in ("slots_sent", "slots_computed", "pairs_sent")] for d in dispatchers(model)],
        dtype=torch.int64,
    )
    if args.ep > 1:
        dist.all_reduce(stats)
    result = {k: torch.tensor(v).max().item() for k, v in worst.items()}
    t = torch.tensor(list(result.values()), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    result = dict(zip(result, t.tolist(), strict=True))
    result["stats"] = stats.tolist()
    result["world"] = world
    if rank == 0:
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, required=True)
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--mtp", type=int, default=0, help="MTP depth (0 = off)")
    ap.add_argument("--out", required=True)
    run_worker(main, ap)
