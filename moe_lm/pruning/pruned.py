"""The pruned model: the source's config with fewer routed experts, and its weights with only the kept ones.

Per MoE layer the kept experts' rows of the stacked expert weights (gate_up_proj, down_proj), of the router's
`weight` and of its `e_score_correction_bias` are taken in ascending id order (plan.py: each group's kept experts
stay contiguous, so n_group and topk_group mean what they meant); everything else, shared experts included, is
copied as it is. The multi-token-prediction modules are left out (model.mtp.depth 0): a training objective and a
draft model, which the next-token logits never read, whose experts no calibration token routes through.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from moe_lm.config import Config
from moe_lm.model import Transformer
from moe_lm.pruning.plan import KeepPlan

ROUTED = ("gate.weight", "gate.e_score_correction_bias", "experts.gate_up_proj", "experts.down_proj")  # [E, ...]


def pruned_config(cfg: Config, plan: KeepPlan) -> Config:
    """`cfg` with the plan's routed experts per layer and no MTP modules, routing without expert groups where the
    plan dropped them (`--ungroup`: n_group 1, topk_group 1); a layout the new count allows (ep_size the largest
    common divisor of the old one and the new count, one pipeline stage: the writer's plain layout)."""
    moe = cfg.model.moe
    groups = {} if plan.n_group == moe.n_group else {"n_group": plan.n_group, "topk_group": 1}
    moe = dataclasses.replace(moe, n_routed_experts=plan.n_keep, **groups)
    model = dataclasses.replace(cfg.model, moe=moe, mtp=dataclasses.replace(cfg.model.mtp, depth=0))
    parallel = dataclasses.replace(cfg.parallel, ep_size=math.gcd(cfg.parallel.ep_size, plan.n_keep), pp_size=1)
    pruned = dataclasses.replace(cfg, model=model, parallel=parallel)
    pruned.validate()
    return pruned


def decoder_moe_layers(model: Transformer) -> list[int]:
    """The MoE layer ids of the decoder (the MTP modules' left out)."""
    return [i for i in model.moe_layer_ids() if i < model.cfg.n_layers]


@torch.no_grad()
def pruned_model(model: Transformer, cfg: Config, plan: KeepPlan) -> Transformer:
    """A new Transformer of `pruned_config(cfg, plan)` holding `model`'s weights with only the kept routed experts
    (eval mode, float32 as loaded)."""
    if plan.layers != decoder_moe_layers(model):
        raise ValueError(f"the plan's layers {plan.layers} are not the model's MoE layers {decoder_moe_layers(model)}")
    new_cfg = pruned_config(cfg, plan)
    state = {}
    for key, value in model.state_dict().items():
        if key.startswith("mtp."):
            continue
        layer, part = routed_part(key)
        state[key] = value.index_select(0, torch.tensor(plan.kept[layer])) if layer in plan.kept and part else value
    pruned = Transformer(new_cfg.model)
    pruned.load_state_dict(state)
    return pruned.eval()


def routed_part(key: str) -> tuple[int | None, str | None]:
    """(layer, which of ROUTED) for a decoder block's state-dict key `layers.<i>.mlp.<part>`; (None, None) else."""
    head, _, rest = key.partition(".")
    index, _, rest = rest.partition(".mlp.")
    if head != "layers" or not index.isdigit() or rest not in ROUTED:
        return None, None
    return int(index), rest
