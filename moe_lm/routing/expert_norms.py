"""The L2 norm of every chosen expert's output, ‖f_j(x)‖₂ before its gate weight multiplies it: REAP's saliency
(moe_lm/pruning/criteria.py) needs it per routed (token, expert), and a trace carries it as its `norms` column.

Shape legend: T = tokens, D = model dim, K = experts per token, N = T * K slots.

Recorded by forward hooks on the experts modules while a trace is recorded: ours (moe_lm/model/experts.py) and
transformers 5's (`model.layers.<l>.mlp.experts` of every MoE architecture it ships: DeepseekV3Experts,
Qwen3MoeExperts, MixtralExperts, ...) share one call, `forward(x [T, D], top_k_index [T, K], top_k_weights [T, K])`.
The hook sees the rows and the chosen experts the module was called with, and calls its forward once more with each
(token, expert) pair a row of its own at weight 1. why again, and not inside the paths: the grouped and MegaBlocks
paths (and transformers' grouped kernels) combine each token's K outputs in one kernel, and training and inference
must pay nothing for a column only the analytics read; the hooks exist only inside `ExpertNormRecorder`, and cost
one more pass of the routed experts while recording.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def slot_norms(experts: nn.Module, x_TD: torch.Tensor, idx_TK: torch.Tensor) -> torch.Tensor:
    """‖Expert_{idx[t, k]}(x[t])‖₂ for every slot [T, K] (float32): each slot a row of its own with weight 1, run by
    the module's own forward (the same kernel, so the same output the combine weighs). why `.forward`: calling the
    module would run its hooks, this one among them."""
    T, K = idx_TK.shape
    x_ND = x_TD.repeat_interleave(K, dim=0)
    ones_N1 = torch.ones(T * K, 1, dtype=x_TD.dtype, device=x_TD.device)
    y_ND = experts.forward(x_ND, idx_TK.reshape(T * K, 1), ones_N1)
    return y_ND.float().norm(dim=-1).view(T, K)


class ExpertNormRecorder:
    """Context manager: forward hooks on `experts` (experts modules by MoE layer id) that keep each layer's slot norms
    [T, K] on the CPU since `clear()` (`take(layer)`; a forward that runs a layer a part of its batch at a time calls
    it once a part), in the order the routing recorder keeps the choices (recorder.py): the router's own order
    (`ranked`, ours: by selection score) or largest gate weight first (transformers' gates return their top-k
    unsorted)."""

    def __init__(self, experts: dict[int, nn.Module], ranked: bool = True) -> None:
        self.experts, self.ranked = experts, ranked
        self.parts: dict[int, list[torch.Tensor]] = {}
        self._hooks = []

    def __enter__(self) -> ExpertNormRecorder:
        for layer, module in self.experts.items():
            self._hooks.append(module.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def clear(self) -> None:
        self.parts.clear()

    def take(self, layer: int) -> torch.Tensor:
        """[T, K] the slot norms of `layer` since `clear()`, in call order."""
        return torch.cat(self.parts[layer])

    def _hook(self, layer: int):
        def hook(module, inputs, output) -> None:
            x_TD, idx_TK, weight_TK = inputs[:3]
            norms = slot_norms(module, x_TD.detach(), idx_TK)
            if not self.ranked:  # as recorder.gate_choices orders the same weights
                norms = norms.gather(-1, weight_TK.float().argsort(dim=-1, descending=True, stable=True))
            self.parts.setdefault(layer, []).append(norms.cpu())

        return hook
