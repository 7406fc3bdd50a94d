"""Routed experts: stacked SwiGLU weights and the local compute paths.

Shape legend: T = tokens, D = model dim, I = expert width, E = (local) experts, K = experts per token,
N = token-slots sorted by expert (N = T*K on one device; whatever arrived on this rank under expert parallelism).

Weights are stacked in HF's layout, gate_up_proj [E, 2I, D] (gate rows first) and down_proj [E, D, I], so that
expert parallelism shards dim 0 and the HF export is a rename.

Paths (all dropless: no capacity factor, no token ever dropped):
- "loop":    per expert, select its token-slots, run it, add back. Obviously correct; the test reference.
- "grouped": sort token-slots by expert once, run every expert over its contiguous segment, scale by the gate
             weights and add back. Segments run as `torch._grouped_mm` on CUDA and as `segment_mlp` on CPU
             (a compiled kernel, or per-expert PyTorch matmuls where it cannot be built; segment_mlp.py).
- "megablocks": MegaBlocks' permutation kernels and grouped GEMM on these same weights (CUDA only; megablocks.py).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lm.model.layers import swiglu
from moe_lm.model.megablocks import load_megablocks, megablocks_experts
from moe_lm.model.segment_mlp import segment_mlp

IMPLS = ("loop", "grouped", "megablocks")


class Experts(nn.Module):
    """E routed SwiGLU experts: y = down(silu(gate x) * up x), stacked weights."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int, impl: str = "grouped", init_std: float = 0.02):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"experts_impl must be one of {IMPLS}, got {impl!r}")
        self.impl = impl
        # why at construction: a run that cannot use MegaBlocks fails before data loading and engine set-up.
        if impl == "megablocks":
            load_megablocks()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * inter_dim, dim).normal_(0.0, init_std))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, inter_dim).normal_(0.0, init_std))

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def forward(
        self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weight_TK: torch.Tensor, shared: nn.Module | None = None
    ) -> torch.Tensor:
        """Weighted sum of each token's K experts, plus `shared(x)` when given: x [T, D], idx/weight [T, K] -> [T, D].

        why the shared experts come in here: the CPU kernel runs them beside the routed experts, in one pass.
        """
        if self.impl == "megablocks":
            y_TD = self._forward_megablocks(x_TD, idx_TK, weight_TK)
            return y_TD if shared is None else y_TD + shared(x_TD)
        T, K = idx_TK.shape
        rows_N = torch.arange(T, device=x_TD.device).repeat_interleave(K)
        return self.forward_slots(x_TD, rows_N, idx_TK.flatten(), weight_TK.flatten(), shared)

    def forward_slots(
        self,
        x_MD: torch.Tensor,
        rows_N: torch.Tensor,
        expert_N: torch.Tensor,
        w_N: torch.Tensor,
        shared: nn.Module | None = None,
    ) -> torch.Tensor:
        """y[rows[n]] += w[n] * Expert_{expert[n]}(x[rows[n]]) for N token-slots, plus shared(x): x [M, D] -> y [M, D].

        The general entry point: an expert-parallel dispatcher calls it on the rows it received.
        """
        if self.impl == "loop":
            y_MD = self._forward_loop(x_MD, rows_N, expert_N, w_N)
        elif self.impl == "megablocks":
            # MegaBlocks' kernels take K slots per row; received rows carry a varying number of local slots, so
            # each slot becomes a row of its own (K = 1) and the results are summed back per row.
            y_ND = self._forward_megablocks(x_MD.index_select(0, rows_N), expert_N[:, None], w_N[:, None])
            y_MD = x_MD.new_zeros(x_MD.shape).index_add(0, rows_N, y_ND)
        else:
            order_N = expert_N.argsort(stable=True)  # token-slots grouped by expert
            token_N = rows_N.index_select(0, order_N)
            counts_E = torch.bincount(expert_N, minlength=self.num_experts)
            w_N = w_N.index_select(0, order_N).to(x_MD.dtype)
            if not (x_MD.is_cuda and hasattr(torch, "_grouped_mm")):
                return segment_mlp(x_MD, token_N, counts_E, w_N, self.gate_up_proj, self.down_proj, shared)
            y_MD = grouped_mm_experts(x_MD, token_N, counts_E, w_N, self.gate_up_proj, self.down_proj)
        return y_MD if shared is None else y_MD + shared(x_MD)

    def _forward_megablocks(self, x_TD, idx_TK, weight_TK) -> torch.Tensor:
        if not x_TD.is_cuda:
            raise RuntimeError(
                f"experts_impl='megablocks' runs on CUDA tensors, got {x_TD.device}: move the model to the GPU, "
                "or use experts_impl='grouped' (same weights)"
            )
        if x_TD.dtype != torch.bfloat16 or self.gate_up_proj.dtype != torch.bfloat16:
            raise RuntimeError(
                f"experts_impl='megablocks' runs in bf16 (MegaBlocks' grouped GEMM), got activations "
                f"{x_TD.dtype} and weights {self.gate_up_proj.dtype}: train with parallel.dtype=bf16 (the GPU "
                "default), or use experts_impl='grouped'"
            )
        return megablocks_experts(load_megablocks(), x_TD, idx_TK, weight_TK, self.gate_up_proj, self.down_proj)

    def _forward_loop(self, x_MD, rows_N, expert_N, w_N) -> torch.Tensor:
        """Reference path: for each expert, its slots' rows, its MLP, weighted index_add back."""
        y_MD = torch.zeros_like(x_MD)
        for e, (gate_up, down) in enumerate(zip(self.gate_up_proj.unbind(0), self.down_proj.unbind(0), strict=True)):
            (sel,) = torch.where(expert_N == e)
            if sel.numel() == 0:
                continue
            rows = rows_N[sel]
            h = swiglu(x_MD[rows] @ gate_up.T) @ down.T
            y_MD.index_add_(0, rows, h * w_N[sel, None].to(h.dtype))
        return y_MD


def grouped_mm_experts(x_MD, token_N, counts_E, w_N, gate_up_EFD, down_EDI):
    """The segments with `torch._grouped_mm` (one kernel per projection; bf16 on CUDA), autograd backward.

    Each expert's rows start at a multiple of 16 bytes' worth of rows, padded with zero rows. why: the weight
    gradients contract over each expert's token rows, and CUDA's grouped GEMM needs every group there 16-byte
    aligned (torchtitan pads its token groups for the same reason). The padded buffer has a fixed size, N plus
    E*(align-1) rows, so no count travels to the host; rows past the last offset are never read.
    Shapes as `SegmentMLP`; P = padded rows.
    """
    N, E = token_N.numel(), counts_E.numel()
    align = max(16 // x_MD.element_size(), 1)
    padded_E = (counts_E + align - 1) // align * align
    pad_end_E = padded_E.cumsum(0)
    expert_N = torch.repeat_interleave(torch.arange(E, device=x_MD.device), counts_E, output_size=N)
    rank_N = torch.arange(N, device=x_MD.device) - (counts_E.cumsum(0) - counts_E)[expert_N]
    row_N = (pad_end_E - padded_E)[expert_N] + rank_N  # each slot's row in the padded buffer
    P = N + E * (align - 1)
    # why index_select/index_copy/index_add and not x[idx]: advanced indexing backpropagates through a serial
    # accumulating put; these are each other's backward.
    x_PD = x_MD.new_zeros(P, x_MD.shape[1]).index_copy(0, row_N, x_MD.index_select(0, token_N))
    w_P = w_N.new_zeros(P).index_copy(0, row_N, w_N)
    offs = pad_end_E.to(torch.int32)
    a_PI = swiglu(torch._grouped_mm(x_PD, gate_up_EFD.transpose(-2, -1), offs=offs)) * w_P[:, None]
    y_PD = torch._grouped_mm(a_PI, down_EDI.transpose(-2, -1), offs=offs)
    return x_MD.new_zeros(x_MD.shape).index_add(0, token_N, y_PD.index_select(0, row_N))
