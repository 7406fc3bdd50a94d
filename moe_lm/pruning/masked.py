"""What removing experts means, on the unpruned model: their selection bias set to -inf while a block runs.

A router chooses from its biased scores s + b, its groups by the sum of each group's top-2 of them; an expert whose
b is -inf is never chosen, and never counts in its group's score, while the gate weights of the chosen experts come
from the unbiased scores as always. That is exactly the routing of the model written without those experts (their
router rows and bias entries dropped, pruned.py), so the ablation criterion measures what pruning would do. Not
moe_lm/routing/around.py's route-around (`moe-lm ablate`), which keeps the groups chosen with the expert in them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def removed(routers: dict[int, nn.Module], gone: dict[int, list[int]]) -> Iterator[None]:
    """Within the block, each MoE layer id's router of `routers` (ours) never selects its experts in `gone`, as if
    they were pruned; the biases are put back afterwards, whatever happens."""
    saved = {layer: routers[layer].e_score_correction_bias.detach().clone() for layer in gone}
    try:
        with torch.no_grad():
            for layer, experts in gone.items():
                routers[layer].e_score_correction_bias[list(experts)] = float("-inf")
        yield
    finally:
        with torch.no_grad():
            for layer, bias in saved.items():
                routers[layer].e_score_correction_bias.copy_(bias)
