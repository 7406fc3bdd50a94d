"""Routing around experts (`moe-lm ablate`, moe_lm/analysis/ablation.py): a router's output as its own rule gives it
with some experts dropped just before its top-k. The router still chooses its groups as always; each token then takes
its next choice within them, with the gate weights of what it now chooses (from the unbiased scores, as always); a
token whose kept groups hold fewer than k remaining experts takes its next choices from any group.

Each kind of router has its rule (a `Rerouter`), given to `TorchRouting` by whoever builds it: ours here
(`around_ours`), the transformers gates' by model type in moe_lm/analysis/hf_routing.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moe_lm.model import Routing
from moe_lm.model.router import gate_weights, limit_to_groups

Rerouter = Callable[[nn.Module, Any, list[int]], Any]  # (router, its output, experts gone) -> its output without them


def around_ours(router: nn.Module, routing: Routing, gone: list[int]) -> Routing:
    """Our Router's output without the `gone` experts: its group limit on the biased scores, its gate weights."""
    cfg = router.cfg
    choice = routing.scores + router.e_score_correction_bias
    kept = limit_to_groups(choice, cfg.n_group, cfg.topk_group) > float("-inf") if cfg.n_group > 1 else None
    idx = topk_without(choice, kept, gone, cfg.num_experts_per_tok)
    weights = gate_weights(routing.scores, idx, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    return Routing(routing.scores, idx, weights)


def topk_without(choice_TE: torch.Tensor, keep_TE: torch.Tensor | None, gone: list[int], K: int) -> torch.Tensor:
    """Top-K [T, K] of `choice` [T, E] within the kept groups (`keep_TE`, None: all) minus `gone`; tokens left with
    fewer than K there choose from all experts but `gone`."""
    allowed = choice_TE.clone()
    allowed[:, gone] = float("-inf")
    if keep_TE is None:
        return allowed.topk(K, dim=-1).indices
    within = allowed.masked_fill(~keep_TE, float("-inf"))
    short = (within > float("-inf")).sum(-1, keepdim=True) < K
    return torch.where(short, allowed, within).topk(K, dim=-1).indices
