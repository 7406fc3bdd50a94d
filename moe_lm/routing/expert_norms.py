"""The L2 norm of every chosen expert's output, ‖f_j(x)‖₂ before its gate weight multiplies it: REAP's saliency
(moe_lm/pruning/criteria.py) needs it per routed (token, expert), and a trace carries it as its `norms` column.

Shape legend: T = tokens, D = model dim, I = expert width, E = experts, K = experts per token.

Recorded by forward hooks on our `Experts` modules (moe_lm/model/experts.py) while a trace is recorded: the hook
sees the rows and the chosen experts the expert path was called with, and runs each chosen expert over its rows
once more. why again, and not inside the paths: the grouped and MegaBlocks paths combine each token's K outputs in
one kernel, and training and inference must pay nothing for a column only the analytics read; the hooks exist only
inside `ExpertNormRecorder`, and cost one more pass of the routed experts while recording.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lm.ops import swiglu


@torch.no_grad()
def slot_norms(x_TD: torch.Tensor, idx_TK: torch.Tensor, gate_up_EFD: torch.Tensor, down_EDI: torch.Tensor):
    """‖Expert_{idx[t, k]}(x[t])‖₂ for every slot [T, K] (float32), the expert's SwiGLU output before any weight."""
    T, K = idx_TK.shape
    expert_N = idx_TK.flatten()
    row_N = torch.arange(T * K, device=x_TD.device) // K
    norms_N = torch.zeros(T * K, dtype=torch.float32, device=x_TD.device)
    for e in expert_N.unique().tolist():
        (sel,) = torch.where(expert_N == e)
        h_SD = swiglu(x_TD[row_N[sel]] @ gate_up_EFD[e].T) @ down_EDI[e].T
        norms_N[sel] = h_SD.float().norm(dim=-1)
    return norms_N.view(T, K)


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
            self.last[layer] = slot_norms(x_TD.detach(), idx_TK, module.gate_up_proj, module.down_proj).cpu()

        return hook
