"""Routed experts: stacked SwiGLU weights and the expert path that runs them.

Shape legend: T = tokens, D = model dim, I = expert width, E = (local) experts, K = slots per row (experts per
token), M = rows of x (T on one device; the rows that arrived on this rank under expert parallelism), N = the
token-slots computed (every one of the M * K on one device; under expert parallelism those of this rank's experts).

Weights are stacked in HF's layout, gate_up_proj [E, 2I, D] (gate rows first) and down_proj [E, D, I], so that
expert parallelism shards dim 0 and the HF export is a rename.

The path is picked once, at construction, from `EXPERT_PATHS` (all dropless: no capacity factor, no token ever
dropped; all take the same weights, so a checkpoint trained with one runs with any other):
- "loop":       per expert, select its token-slots, run it, add back. Obviously correct; the test reference.
- "grouped":    sort token-slots by expert once, run every expert over its segment (moe_lm/ops/grouped.py).
- "megablocks": MegaBlocks' kernels on these same weights (CUDA only; moe_lm/ops/megablocks.py).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lm.ops import swiglu
from moe_lm.ops.grouped import grouped_experts
from moe_lm.ops.megablocks import load_megablocks, megablocks_experts


def loop_experts(x_MD, expert_MK, w_MK, gate_up_EFD, down_EDI, slot_N=None) -> torch.Tensor:
    """Reference path: for each expert, its slots' rows, its MLP, weighted index_add back."""
    K = expert_MK.shape[1]
    slot_N = torch.arange(expert_MK.numel(), device=x_MD.device) if slot_N is None else slot_N
    rows_N, expert_N, w_N = slot_N // K, expert_MK.flatten()[slot_N], w_MK.flatten()[slot_N]
    y_MD = torch.zeros_like(x_MD)
    for e, (gate_up, down) in enumerate(zip(gate_up_EFD.unbind(0), down_EDI.unbind(0), strict=True)):
        (sel,) = torch.where(expert_N == e)
        if sel.numel() == 0:
            continue
        rows = rows_N[sel]
        h = swiglu(x_MD[rows] @ gate_up.T) @ down.T
        y_MD.index_add_(0, rows, h * w_N[sel, None].to(h.dtype))
    return y_MD


# One signature: (x [M, D], expert [M, K], w [M, K], gate_up [E, 2I, D], down [E, D, I], slot_N [N] or None)
# -> y [M, D], y[m] = sum over the computed slots (m, k) of w[m, k] * Expert_{expert[m, k]}(x[m]); slot_N holds the
# computed slots' flat ids m * K + k (None: every slot).
EXPERT_PATHS = {"loop": loop_experts, "grouped": grouped_experts, "megablocks": megablocks_experts}


class Experts(nn.Module):
    """E routed SwiGLU experts: y = down(silu(gate x) * up x), stacked weights."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int, impl: str = "grouped", init_std: float = 0.02):
        super().__init__()
        if impl not in EXPERT_PATHS:
            raise ValueError(f"experts_impl must be one of {tuple(EXPERT_PATHS)}, got {impl!r}")
        # why at construction: a run that cannot use MegaBlocks fails before data loading and engine set-up.
        if impl == "megablocks":
            load_megablocks()
        self.impl = impl
        self.path = EXPERT_PATHS[impl]
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * inter_dim, dim).normal_(0.0, init_std))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, inter_dim).normal_(0.0, init_std))

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def forward(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
        """Weighted sum of each token's K experts: x [T, D], idx/weight [T, K] -> [T, D]."""
        return self.path(x_TD, idx_TK, weight_TK, self.gate_up_proj, self.down_proj)

    def forward_slots(
        self, x_MD: torch.Tensor, expert_MK: torch.Tensor, w_MK: torch.Tensor, slot_N: torch.Tensor
    ) -> torch.Tensor:
        """y[m] = sum over the slots slot_N (flat ids m * K + k) of w[m, k] * Expert_{expert[m, k]}(x[m]): x [M, D]
        -> y [M, D]. What an expert-parallel dispatcher calls on the rows it received: each row's slots on this
        rank's experts (its other slots name other ranks' experts, and are left out)."""
        return self.path(x_MD, expert_MK, w_MK, self.gate_up_proj, self.down_proj, slot_N)
