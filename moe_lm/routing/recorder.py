"""What the routers chose, recorded from their outputs by forward hooks: our `Routing`, or the (logits, weights,
indices) a transformers gate returns. Never a recomputation from logits: under biased, group-limited routing only
the router knows what it chose. Training's evaluation, the routing traces and the experiments all read it here.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from moe_lm.model import Routing
from moe_lm.routing.stats import decision_margins


def routers_by_layer(model) -> dict[int, nn.Module]:
    """Our models' routers (a Transformer's, the encoder-decoder variant's) by MoE layer id, MTP blocks' included."""
    return dict(zip(model.moe_layer_ids(), model.routers(), strict=True))


class RoutingRecorder:
    """Context manager: forward hooks on `routers` (by MoE layer id: ours, or transformers' gates) that keep each
    layer's last choice, (experts [T, K], weights [T, K]) on the CPU, from what the router returned, and with
    `margins` (our routers only) each decision's margin [T]. With `parts`, every choice since `last` and `margins`
    were cleared, in order: a forward pass that runs a layer over its batch a part at a time (interop/hf_layers.py,
    `hf_forward`) calls its router once a part."""

    def __init__(self, routers: dict[int, nn.Module], margins: bool = False, parts: bool = False) -> None:
        self.routers = routers
        self.with_margins, self.parts = margins, parts
        self.layers = sorted(routers)
        self.last: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.margins: dict[int, np.ndarray] = {}
        self._hooks = []

    def __enter__(self) -> RoutingRecorder:
        for layer_id in self.layers:
            self._hooks.append(self.routers[layer_id].register_forward_hook(self._hook(layer_id)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _hook(self, layer_id: int):
        def hook(module, inputs, output) -> None:
            idx, w = (output.topk_idx, output.topk_weight) if isinstance(output, Routing) else gate_choices(output)
            idx, w = idx.detach().cpu(), w.detach().cpu()
            if self.parts and layer_id in self.last:  # the router called on the next part of the batch
                idx, w = torch.cat((self.last[layer_id][0], idx)), torch.cat((self.last[layer_id][1], w))
            self.last[layer_id] = (idx, w)
            if self.with_margins and isinstance(output, Routing):  # selection scores: the affinities plus the bias
                cfg, bias = module.cfg, module.e_score_correction_bias
                scores = output.scores.detach().float() + (bias.float() if bias is not None else 0.0)
                margins = decision_margins(scores.cpu().numpy(), cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group)
                if self.parts and layer_id in self.margins:
                    margins = np.concatenate((self.margins[layer_id], margins))
                self.margins[layer_id] = margins

        return hook


def gate_choices(output) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [T, K], weights [T, K]) from an HF gate's (logits, weights, indices), largest weight first."""
    _, weights, indices = output
    order = weights.float().argsort(dim=-1, descending=True, stable=True)
    return indices.gather(-1, order), weights.float().gather(-1, order)
