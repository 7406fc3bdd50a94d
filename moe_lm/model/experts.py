"""Routed experts: stacked SwiGLU weights and the expert path that runs them.

Shape legend: T = tokens, D = model dim, I = expert width, E = (local) experts, K = experts per token,
M = rows of x, N = token-slots (N = T*K on one device; whatever arrived on this rank under expert parallelism).

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


def loop_experts(x_MD, rows_N, expert_N, w_N, gate_up_EFD, down_EDI) -> torch.Tensor:
    """Reference path: for each expert, its slots' rows, its MLP, weighted index_add back."""
    y_MD = torch.zeros_like(x_MD)
    for e, (gate_up, down) in enumerate(zip(gate_up_EFD.unbind(0), down_EDI.unbind(0), strict=True)):
        (sel,) = torch.where(expert_N == e)
        if sel.numel() == 0:
            continue
        rows = rows_N[sel]
        h = swiglu(x_MD[rows] @ gate_up.T) @ down.T
        y_MD.index_add_(0, rows, h * w_N[sel, None].to(h.dtype))
    return y_MD


# One signature: (x [M, D], rows [N], expert [N], w [N], gate_up [E, 2I, D], down [E, D, I]) -> y [M, D].
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
        T, K = idx_TK.shape
        rows_N = torch.arange(T, device=x_TD.device).repeat_interleave(K)
        return self.forward_slots(x_TD, rows_N, idx_TK.flatten(), weight_TK.flatten())

    def forward_slots(
        self, x_MD: torch.Tensor, rows_N: torch.Tensor, expert_N: torch.Tensor, w_N: torch.Tensor
    ) -> torch.Tensor:
        """y[rows[n]] += w[n] * Expert_{expert[n]}(x[rows[n]]) for N token-slots: x [M, D] -> y [M, D].

        The general entry point: an expert-parallel dispatcher calls it on the rows it received.
        """
        return self.path(x_MD, rows_N, expert_N, w_N, self.gate_up_proj, self.down_proj)
