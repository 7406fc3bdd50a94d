"""Routes forced into our routers: a forward pass whose MoE layers use given experts (and gate weights) instead of
their own choice; what routing replay does in RL (R3: the trainer replays the rollout engine's experts), and what
splits a model's drift into its routing and its weights (moe_lm/analysis/attribution.py).

A forced layer's router still computes its scores (they are the model's own), then hands on the given experts with
the given gate weights, or, with `weights=False`, with its own gate weights for those experts (`gate_weights`: the
experts-only replay of RL frameworks, which recompute the weights from the trainer's router).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from moe_lm.model import Routing
from moe_lm.model.router import gate_weights
from moe_lm.routing.recorder import RoutingRecorder, routers_by_layer

Routes = dict[int, tuple[torch.Tensor, torch.Tensor]]  # MoE layer id -> (experts [T, K], gate weights [T, K])


@contextmanager
def forced_routes(model, routes: Routes, weights: bool = True):
    """Within the block, every forward pass of `model` (our Transformer) routes the layers in `routes` as given
    (the tokens of the pass in order, T rows: one pass per set of routes); the other layers choose as usual."""
    routers = routers_by_layer(model)
    hooks = []

    def force(layer: int):
        idx, w = routes[layer]

        def hook(module, inputs, out: Routing) -> Routing:
            if out.topk_idx.shape != idx.shape:
                raise ValueError(f"MoE layer {layer}: forced routes for {tuple(idx.shape)} slots, the pass has "
                                 f"{tuple(out.topk_idx.shape)}")  # fmt: skip
            forced = idx.to(out.topk_idx.device)
            if weights:
                return Routing(out.scores, forced, w.to(out.topk_weight))
            cfg = module.cfg
            return Routing(out.scores, forced, gate_weights(out.scores, forced, cfg.norm_topk_prob,
                                                             cfg.routed_scaling_factor))  # fmt: skip

        return hook

    try:
        hooks = [routers[layer].register_forward_hook(force(layer)) for layer in routes]
        yield
    finally:
        for h in hooks:
            h.remove()


def decoder_routes(model) -> RoutingRecorder:
    """The recorder of the decoder's routers (its `last`: each MoE layer's (experts, gate weights) as the router
    handed them on, forced or its own), the routes `forced_routes` takes."""
    return RoutingRecorder({i: r for i, r in routers_by_layer(model).items() if i < model.cfg.n_layers})
