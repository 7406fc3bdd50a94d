"""What removing experts means, on the unpruned model: their selection bias set to -inf while a block runs.

A router chooses from its biased scores s + b, its groups by the sum of each group's top-2 of them; an expert whose
b is -inf is never chosen, and never counts in its group's score, while the gate weights of the chosen experts come
from the unbiased scores as always. That is exactly the routing of the model written without those experts (their
router rows and bias entries dropped, pruned.py), so the ablation criterion measures what pruning would do. Not
moe_lm/routing/around.py's route-around (`moe-lm ablate`), which keeps the groups chosen with the expert in them.

A router without a selection bias (Qwen3-MoE's softmax gate: no groups, its top-k renormalised) is given its own
rule with the experts dropped just before the top-k instead (around.py's `Rerouter`, `reroute`): without groups that
is the same masking, and what its pruned copy computes (formats.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from moe_lm.routing.around import Rerouter


@contextlib.contextmanager
def removed(
    routers: dict[int, nn.Module], gone: dict[int, list[int]], reroute: Rerouter | None = None
) -> Iterator[None]:
    """Within the block, each MoE layer id's router of `routers` never selects its experts in `gone`, as if they were
    pruned: a selection bias at -inf (ours, DeepSeek-V3's and GLM-4.5's gates), put back afterwards whatever happens;
    a router without one rerouted by `reroute` (the module docstring)."""
    biased = {layer: e for layer, e in gone.items() if hasattr(routers[layer], "e_score_correction_bias")}
    saved = {layer: routers[layer].e_score_correction_bias.detach().clone() for layer in biased}
    hooks = [routers[layer].register_forward_hook(lambda m, i, out, e=list(e): reroute(m, out, e), prepend=True)
             for layer, e in gone.items() if layer not in biased]  # fmt: skip
    try:
        with torch.no_grad():
            for layer, experts in biased.items():
                routers[layer].e_score_correction_bias[list(experts)] = float("-inf")
        yield
    finally:
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            for layer, bias in saved.items():
                routers[layer].e_score_correction_bias.copy_(bias)
