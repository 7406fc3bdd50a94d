"""Auxiliary-loss-free balancing, once per optimizer step: global counts -> MaxVio -> bias update -> reset.

The routers count token-slots during the step's training forward passes (all micro-batches). Here the counts are
summed over every data-parallel rank as int64 (never bf16), so every rank applies the identical update and the
biases stay equal everywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_lm.model import Transformer, update_biases
from moe_lm.routing.stats import max_vio


def global_counts(model: Transformer) -> list[torch.Tensor]:
    """Per MoE layer, token-slots per expert in this step over all ranks (int64, CPU)."""
    routers = model.routers()
    if not routers:
        return []
    local = torch.stack([r.tokens_per_expert for r in routers])  # [L, E]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local, op=dist.ReduceOp.SUM)
    return list(local.cpu().unbind(0))


def balance_step(model: Transformer, speed: float, apply: bool = True) -> tuple[dict[str, float], list[torch.Tensor]]:
    """Update every router's bias from this step's global counts (if `apply`), reset counts.

    Returns per-layer scalars (MaxVio_batch, bias mean/std/min/max) and the per-layer counts.
    """
    counts = global_counts(model)
    routers = model.routers()
    if apply and speed > 0:
        update_biases(routers, counts, speed)
    for r in routers:
        r.tokens_per_expert.zero_()
    metrics = {}
    if not routers:
        return metrics, counts
    # why one stacked tensor and one transfer: four .item() calls per layer each wait for the device
    b = torch.stack([r.e_score_correction_bias for r in routers])  # [L, E]
    stats = torch.stack([b.mean(1), b.std(1), b.min(1).values, b.max(1).values], 1).tolist()
    for layer, c, (mean, std, low, high) in zip(model.moe_layer_ids(), counts, stats, strict=True):
        metrics[f"maxvio/layer_{layer}"] = max_vio(c.numpy())
        metrics[f"bias_mean/layer_{layer}"] = mean
        metrics[f"bias_std/layer_{layer}"] = std
        metrics[f"bias_min/layer_{layer}"] = low
        metrics[f"bias_max/layer_{layer}"] = high
    return metrics, counts
