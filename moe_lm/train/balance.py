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


def _summed_counts(routers: list) -> torch.Tensor | None:
    """[L, E] token-slots per expert in this step over all ranks (int64, on the routers' device); None without
    routers."""
    if not routers:
        return None
    local = torch.stack([r.tokens_per_expert for r in routers])  # [L, E]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local, op=dist.ReduceOp.SUM)
    return local


def balance_step(
    model: Transformer, speed: float, apply: bool = True, metrics: bool = True
) -> tuple[dict[str, float], list[torch.Tensor]]:
    """Update every router's bias from this step's global counts (if `apply`), reset counts.

    Returns per-layer scalars (MaxVio_batch, bias mean/std/min/max) and the per-layer counts (CPU); with
    `metrics=False` neither (empty), and nothing waits for the device: the update reads the counts where they are.
    """
    routers = model.routers()
    summed = _summed_counts(routers)
    if apply and speed > 0 and summed is not None:
        update_biases(routers, list(summed.unbind(0)), speed)  # the same float64 sums on either device: exact
    for r in routers:
        r.tokens_per_expert.zero_()
    if not metrics or summed is None:
        return {}, []
    return _metrics(model, routers, list(summed.cpu().unbind(0)))


def _metrics(model: Transformer, routers: list, counts: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
    """Per MoE layer MaxVio_batch from the step's counts and the bias statistics after its update."""
    # why one stacked tensor and one transfer: four .item() calls per layer each wait for the device
    b = torch.stack([r.e_score_correction_bias for r in routers])  # [L, E]
    stats = torch.stack([b.mean(1), b.std(1), b.min(1).values, b.max(1).values], 1).tolist()
    metrics = {}
    for layer, c, (mean, std, low, high) in zip(model.moe_layer_ids(), counts, stats, strict=True):
        metrics[f"maxvio/layer_{layer}"] = max_vio(c.numpy())
        metrics[f"bias_mean/layer_{layer}"] = mean
        metrics[f"bias_std/layer_{layer}"] = std
        metrics[f"bias_min/layer_{layer}"] = low
        metrics[f"bias_max/layer_{layer}"] = high
    return metrics, counts
