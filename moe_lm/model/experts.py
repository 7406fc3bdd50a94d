"""Routed experts: stacked SwiGLU weights and the local compute paths.

Shape legend: T = tokens, D = model dim, I = expert width, E = (local) experts, K = experts per token,
N = token-slots sorted by expert (N = T*K on one device; whatever arrived on this rank under expert parallelism).

Weights are stacked in HF's layout, gate_up_proj [E, 2I, D] (gate rows first) and down_proj [E, D, I], so that
expert parallelism shards dim 0 and the HF export is a rename.

Paths (all dropless: no capacity factor, no token ever dropped):
- "loop":    per expert, select its token-slots, run it, add back. Obviously correct; the test reference.
- "grouped": sort token-slots by expert once, run every expert over its contiguous segment, unsort and
             combine with the gate weights. Segments run as `torch._grouped_mm` on CUDA and as a loop of
             matmuls over unbound weights on CPU, which is faster there (see DEEPSPEED_NOTES §6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    """E routed SwiGLU experts: y = down(silu(gate x) * up x), stacked weights."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int, impl: str = "grouped", init_std: float = 0.02):
        super().__init__()
        if impl not in ("loop", "grouped"):
            raise ValueError(f"experts_impl must be 'loop' or 'grouped', got {impl!r}")
        self.impl = impl
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * inter_dim, dim).normal_(0.0, init_std))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, inter_dim).normal_(0.0, init_std))

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def forward(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
        """Weighted sum of each token's K experts: x [T, D], idx/weight [T, K] -> [T, D]."""
        if self.impl == "loop":
            return self.forward_loop(x_TD, idx_TK, weight_TK)
        T, K = idx_TK.shape
        flat_idx = idx_TK.flatten()
        order_N = flat_idx.argsort(stable=True)  # token-slots grouped by expert
        counts_E = torch.bincount(flat_idx, minlength=self.num_experts)
        y_ND = self.forward_sorted(x_TD[order_N // K], counts_E)
        # Unsort with a gather (cheaper than a scatter, also in backward) and combine with one batched matmul.
        y_TKD = y_ND[order_N.argsort()].view(T, K, -1)
        return torch.bmm(weight_TK.to(y_TKD.dtype).unsqueeze(1), y_TKD).squeeze(1)

    def forward_sorted(self, x_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Run expert e over the e-th contiguous segment of x [N, D] (counts [E] sum to N) -> [N, D]."""
        if x_ND.is_cuda and hasattr(torch, "_grouped_mm"):
            return grouped_mm_segments(x_ND, counts_E, self.gate_up_proj, self.down_proj)
        return loop_segments(x_ND, counts_E, self.gate_up_proj, self.down_proj)

    def forward_loop(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
        """Reference path: for each expert, its tokens, its MLP, weighted index_add back."""
        y_TD = torch.zeros_like(x_TD)
        for e, (gate_up, down) in enumerate(zip(self.gate_up_proj.unbind(0), self.down_proj.unbind(0), strict=True)):
            token, slot = torch.where(idx_TK == e)
            if token.numel() == 0:
                continue
            h = _swiglu(x_TD[token] @ gate_up.T) @ down.T
            y_TD.index_add_(0, token, h * weight_TK[token, slot, None].to(h.dtype))
        return y_TD


def loop_segments(x_ND: torch.Tensor, counts_E: torch.Tensor, gate_up_EFD: torch.Tensor, down_EDI: torch.Tensor):
    """Segment compute as one matmul pair per expert over unbound weights (fast on CPU)."""
    # why unbind and not w[e]: indexing a 3-D weight per expert makes backward build a full-size gradient per
    # slice (6x slower at E=64); unbind's backward stacks once.
    outs = [
        _swiglu(x_e @ gate_up.T) @ down.T
        for x_e, gate_up, down in zip(
            x_ND.split(counts_E.tolist()), gate_up_EFD.unbind(0), down_EDI.unbind(0), strict=True
        )
    ]
    return torch.cat(outs)


def grouped_mm_segments(x_ND: torch.Tensor, counts_E: torch.Tensor, gate_up_EFD: torch.Tensor, down_EDI: torch.Tensor):
    """Segment compute with `torch._grouped_mm` (one kernel per projection; bf16 on CUDA)."""
    offs = counts_E.cumsum(0).to(torch.int32)
    h_NF = torch._grouped_mm(x_ND, gate_up_EFD.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(_swiglu(h_NF), down_EDI.transpose(-2, -1), offs=offs)


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
