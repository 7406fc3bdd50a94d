"""The L2 norm of every chosen expert's output, ‖f_j(x)‖₂ before its gate weight multiplies it: REAP's saliency
(moe_lm/pruning/criteria.py) needs it per routed (token, expert), and a trace carries it as its `norms` column.

Shape legend: T = tokens, D = model dim, K = experts per token, N = T * K slots.

Recorded by forward hooks on our `Experts` modules (moe_lm/model/experts.py) while a trace is recorded: the hook
sees the rows and the chosen experts the expert path was called with, and runs the path once more with each
(token, expert) pair a row of its own at weight 1. why again, and not inside the paths: the grouped and MegaBlocks
paths combine each token's K outputs in one kernel, and training and inference must pay nothing for a column only
the analytics read; the hooks exist only inside `ExpertNormRecorder`, and cost one more pass of the routed experts
while recording.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def slot_norms(experts: nn.Module, x_TD: torch.Tensor, idx_TK: torch.Tensor) -> torch.Tensor:
    """‖Expert_{idx[t, k]}(x[t])‖₂ for every slot [T, K] (float32): each slot a row of its own with weight 1, run by
    the module's own expert path (the same kernel, so the same output the combine weighs)."""
    T, K = idx_TK.shape
    x_ND = x_TD.repeat_interleave(K, dim=0)
    ones_N1 = torch.ones(T * K, 1, dtype=x_TD.dtype, device=x_TD.device)
    y_ND = experts.path(x_ND, idx_TK.reshape(T * K, 1), ones_N1, experts.gate_up_proj, experts.down_proj)
    return y_ND.float().norm(dim=-1).view(T, K)


class ExpertNormRecorder:
    """Context manager: forward hooks on `experts` (our Experts modules, by MoE layer id) that keep each layer's last
    call's slot norms [T, K] on the CPU (`last`), in the order of the router's choices for the same rows."""

    def __init__(self, experts: dict[int, nn.Module]) -> None:
        self.experts = experts
        self.last: dict[int, torch.Tensor] = {}
        self._hooks = []

    def __enter__(self) -> ExpertNormRecorder:
        for layer, module in self.experts.items():
            self._hooks.append(module.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _hook(self, layer: int):
        def hook(module, inputs, output) -> None:
            x_TD, idx_TK = inputs[0], inputs[1]
            self.last[layer] = slot_norms(module, x_TD.detach(), idx_TK).cpu()

        return hook
