"""Expert-parallel training steps against a single-process reference, on every rank of a forked job
(tests/helpers/ranks.py): `ranks(expert_parallel_cases, 4, [(2, "zero2"), (4, "zero1,zero2")])`.

Every rank builds the same model; the reference (all experts, no DeepSpeed) runs the whole global batch with
torch AdamW and clipping, the EP model runs this rank's share under DeepSpeed. Compared after each of two steps:
logits of this rank's sequences, the gradient norm, and every parameter (experts against their global slice).
Several cases (and expert-parallel sizes) run in one job: `zero1`, `zero2`, and suffixes: `-mtp2` (MTP depth 2),
`-starve` (the last rank's experts get a selection bias of -1e4, so no token reaches that rank), `-groups2x1`
(n_group 2, topk_group 1: with two nodes, node-limited routing to one node). Rank 0 returns, per expert-parallel
size and case, the largest differences, every rank's dispatcher counters per MoE layer, and every rank's routing
(chosen experts per layer).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_lm.config import Config, LoggingConfig, MLAConfig, MTPConfig, OptimConfig, ParallelConfig, TrainConfig
from moe_lm.model import Transformer
from moe_lm.parallel.deepspeed_setup import build_engine, param_groups
from moe_lm.parallel.expert_parallel import apply_expert_parallel, dispatchers, ensure_groups, ep_nodes
from moe_lm.testing import tiny_model_cfg
from moe_lm.train.objective import next_token_losses, total_loss

MICRO, SEQ, VOCAB = 2, 12, 64


def case_config(case: str, ep: int) -> Config:
    parts = case.split("-")
    zero = int(parts[0].removeprefix("zero"))
    mtp = next((int(p[3:]) for p in parts if p.startswith("mtp")), 0)
    groups = next((p[6:].split("x") for p in parts if p.startswith("groups")), (4, 2))
    return Config(
        model=tiny_model_cfg(
            vocab_size=VOCAB,
            n_heads=2,
            inter_dim=64,
            max_seq_len=SEQ,
            mla=MLAConfig(),
            moe=dict(
                routed_scaling_factor=1.0,
                moe_inter_dim=16,
                seq_aux_alpha=1e-2,
                bias_update_speed=0.0,
                n_group=int(groups[0]),
                topk_group=int(groups[1]),
            ),
            mtp=MTPConfig(depth=mtp),
        ),
        # eps 1e-6, not 1e-8: where a gradient element is ~1e-8, Adam's update g/(|g|+eps) turns fp32 rounding
        # differences (an expert's rows summed in another order) into ~1e-5 parameter differences, which would
        # swamp the 1e-5 comparison below; 1e-6 keeps Adam well-conditioned there.
        optim=OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=0.05, weight_decay=0.1, eps=1e-6),
        train=TrainConfig(micro_batch_size=MICRO, grad_accum_steps=1, seq_len=SEQ),
        parallel=ParallelConfig(zero_stage=zero, ep_size=ep),
        logging=LoggingConfig(wandb_mode="disabled"),
    )


def reference_loss(ref_out, tokens: torch.Tensor, mtp: int) -> torch.Tensor:
    """The global batch's loss written out: mean CE per head, L_MTP = (0.3 / D) sum_k CE_k, plus the aux loss."""
    loss = F.cross_entropy(ref_out.logits.flatten(0, 1), tokens[:, 1:].flatten()) + ref_out.aux_loss
    for k, logits in enumerate(ref_out.mtp_logits, start=1):
        loss = loss + 0.3 / mtp * F.cross_entropy(logits.flatten(0, 1), tokens[:, 1 + k :].flatten())
    return loss


def run_case(case: str, ep: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = case_config(case, ep)
    mtp = cfg.model.mtp.depth
    torch.manual_seed(0)
    full = Transformer(cfg.model)
    E = cfg.model.moe.n_routed_experts
    n_local = E // ep
    if "starve" in case:  # selection-only: no token picks the last rank's experts, their gate weights are unchanged
        for moe in full.moe_layers():
            moe.gate.e_score_correction_bias[E - n_local :] = -1e4
    reference = copy.deepcopy(full).train()
    o = cfg.optim
    ref_opt = torch.optim.AdamW(param_groups(reference, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    engine = build_engine(apply_expert_parallel(full, ep), optim=cfg.optim, train=cfg.train, parallel=cfg.parallel)
    model = engine.module
    routing: list[list] = [[] for _ in model.moe_layers()]
    for i, moe in enumerate(model.moe_layers()):
        moe.gate.register_forward_hook(lambda m, a, out, i=i: routing[i].extend(out.topk_idx.tolist()))
    ep_rank = dist.get_rank(group=ensure_groups(ep))
    gen = torch.Generator().manual_seed(7)
    worst = {"logits": 0.0, "grad_norm_rel": 0.0, "params": 0.0}
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (world * MICRO, SEQ + 1), generator=gen)
        mine = tokens[rank * MICRO : (rank + 1) * MICRO]
        out = engine(mine[:, :-1], mtp=True)
        engine.backward(total_loss(*next_token_losses(out, mine[:, 1:]), 0.3, out.aux_loss))
        engine.step()
        ref_out = reference(tokens[:, :-1], mtp=True)
        reference_loss(ref_out, tokens, mtp).backward()
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
                expected = ref_params[name.replace("deepspeed_moe.experts.", "")][keep]
            else:
                expected = ref_params[name]
            worst["params"] = max(worst["params"], (p.detach() - expected.detach()).abs().max().item())
    t = torch.tensor(list(worst.values()), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    mine = {"stats": [d.stats for d in dispatchers(model)], "routing": routing}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    return {**dict(zip(worst, t.tolist(), strict=True)), "ranks": every}


def expert_parallel_cases(jobs: list[tuple[int, str]]) -> dict | None:
    """For each (ep_size, "case,case,..."): its cases' results, the world size and each EP rank's node (on rank 0;
    None elsewhere)."""
    results = {}
    for ep, cases in jobs:
        result = {case: run_case(case, ep) for case in cases.split(",")}
        result["world"] = dist.get_world_size()
        result["nodes"] = ep_nodes(ensure_groups(ep))
        results[ep] = result
    return results if dist.get_rank() == 0 else None
