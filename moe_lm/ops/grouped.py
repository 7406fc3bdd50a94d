"""The "grouped" expert path: sort the token-slots by expert once, then run every expert over its segment.

Shape legend: M = rows of x, D = model dim, I = expert width, E = experts, N = token-slots, P = padded rows.

The segments run as `torch._grouped_mm` on CUDA (one kernel per projection, bf16) and as `segment_mlp` on CPU
(the compiled kernel, or per-expert PyTorch matmuls where it cannot be built). Dropless: no capacity factor.
"""

from __future__ import annotations

import torch

from moe_lm.ops import expert_counts, swiglu
from moe_lm.ops.segment_mlp import segment_mlp


def grouped_experts(x_MD, rows_N, expert_N, w_N, gate_up_EFD, down_EDI) -> torch.Tensor:
    """y[rows[n]] += w[n] * Expert_{expert[n]}(x[rows[n]]): x [M, D] -> y [M, D]."""
    order_N = expert_N.argsort(stable=True)  # token-slots grouped by expert
    token_N = rows_N.index_select(0, order_N)
    counts_E = expert_counts(expert_N, gate_up_EFD.shape[0])
    w_N = w_N.index_select(0, order_N).to(x_MD.dtype)
    segments = grouped_mm if x_MD.is_cuda and hasattr(torch, "_grouped_mm") else segment_mlp
    return segments(x_MD, token_N, counts_E, w_N, gate_up_EFD, down_EDI)


def grouped_mm(x_MD, token_N, counts_E, w_N, gate_up_EFD, down_EDI) -> torch.Tensor:
    """The segments with `torch._grouped_mm` (one kernel per projection; bf16 on CUDA), autograd backward.

    Each expert's rows start at a multiple of 16 bytes' worth of rows, padded with zero rows. why: the weight
    gradients contract over each expert's token rows, and CUDA's grouped GEMM needs every group there 16-byte
    aligned (torchtitan pads its token groups for the same reason). The padded buffer has a fixed size, N plus
    E*(align-1) rows, so no count travels to the host. The last offset is P: the rows past the last expert's own
    (zeros, weight 0) belong to it, so that every output row is written. why: `_grouped_mm` leaves rows past the
    last offset uninitialised in its output and in autograd's dX, and a later backward reading recycled memory
    there can turn 0 * NaN into NaN (pytorch#193633).
    Shapes as `segment_mlp`.
    """
    if x_MD.dtype in (torch.bfloat16, torch.float16) and (x_MD.shape[1] % 8 or down_EDI.shape[2] % 8):
        raise ValueError(
            f"torch._grouped_mm needs 16-byte strides: model.dim ({x_MD.shape[1]}) and model.moe.moe_inter_dim "
            f"({down_EDI.shape[2]}) must be multiples of 8 in bf16"
        )
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
    # why a device-side fill and not `offs[-1] = P`: writing a Python int into a CUDA tensor waits for the host
    offs = torch.cat((pad_end_E[:-1], pad_end_E.new_full((1,), P))).to(torch.int32)
    a_PI = swiglu(torch._grouped_mm(x_PD, gate_up_EFD.transpose(-2, -1), offs=offs)) * w_P[:, None]
    y_PD = torch._grouped_mm(a_PI, down_EDI.transpose(-2, -1), offs=offs)
    return x_MD.new_zeros(x_MD.shape).index_add(0, token_N, y_PD.index_select(0, row_N))
