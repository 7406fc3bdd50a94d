"""The "grouped" expert path: sort the token-slots by expert once, then run every expert over its segment.

Shape legend: M = rows of x, D = model dim, I = expert width, E = experts, K = slots per row, N = token-slots
computed, P = padded rows.

The segments run as `torch._grouped_mm` on CUDA (one kernel per projection, bf16), its rows moved in and out by
gathers only (slot_rows.py: deterministic, no atomics), and as `segment_mlp` on CPU (the compiled kernel, or
per-expert PyTorch matmuls where it cannot be built). Dropless: no capacity factor.
"""

from __future__ import annotations

import torch

from moe_lm.ops import expert_counts, swiglu
from moe_lm.ops.segment_mlp import segment_mlp
from moe_lm.ops.slot_rows import SlotMap, combine_slots, gather_slots, slot_map


def grouped_experts(x_MD, expert_MK, w_MK, gate_up_EFD, down_EDI, slot_N=None) -> torch.Tensor:
    """y[m] = sum_k w[m, k] * Expert_{expert[m, k]}(x[m]) over the slots slot_N (flat ids m * K + k; None: all):
    x [M, D] -> y [M, D]."""
    if x_MD.is_cuda and hasattr(torch, "_grouped_mm"):
        return grouped_mm(x_MD, expert_MK, w_MK, gate_up_EFD, down_EDI, slot_N)
    K = expert_MK.shape[1]
    expert_N, w_N = _flat(expert_MK, slot_N), _flat(w_MK, slot_N)
    row_N = torch.arange(expert_MK.numel(), device=x_MD.device) // K if slot_N is None else slot_N // K
    order_N = expert_N.argsort(stable=True)  # token-slots grouped by expert
    counts_E = expert_counts(expert_N, gate_up_EFD.shape[0])
    w_N = w_N.index_select(0, order_N).to(x_MD.dtype)
    return segment_mlp(x_MD, row_N.index_select(0, order_N), counts_E, w_N, gate_up_EFD, down_EDI)


def _flat(a_MK: torch.Tensor, slot_N) -> torch.Tensor:
    return a_MK.flatten() if slot_N is None else a_MK.flatten().index_select(0, slot_N)


def grouped_mm(x_MD, expert_MK, w_MK, gate_up_EFD, down_EDI, slot_N=None) -> torch.Tensor:
    """The segments with `torch._grouped_mm` (one kernel per projection; bf16 on CUDA), autograd backward; the rows
    gathered into the padded buffer and the expert outputs combined per row by gathers (slot_rows.py), the
    weighted sum in float32. Shapes as `grouped_experts`."""
    if x_MD.dtype in (torch.bfloat16, torch.float16) and (x_MD.shape[1] % 8 or down_EDI.shape[2] % 8):
        raise ValueError(
            f"torch._grouped_mm needs 16-byte strides: model.dim ({x_MD.shape[1]}) and model.moe.moe_inter_dim "
            f"({down_EDI.shape[2]}) must be multiples of 8 in bf16"
        )
    smap, offs = expert_buffer(expert_MK, gate_up_EFD.shape[0], max(16 // x_MD.element_size(), 1), slot_N)
    x_PD = gather_slots(x_MD, smap)
    a_PI = swiglu(torch._grouped_mm(x_PD, gate_up_EFD.transpose(-2, -1), offs=offs))
    y_PD = torch._grouped_mm(a_PI, down_EDI.transpose(-2, -1), offs=offs)
    return combine_slots(y_PD, smap, w_MK)


def expert_buffer(expert_MK, E: int, align: int, slot_N=None) -> tuple[SlotMap, torch.Tensor]:
    """Where each slot sits in `_grouped_mm`'s buffer, and the groups' end offsets (int32 [E]).

    The slots are sorted by expert, and each expert's rows start at a multiple of `align` rows (16 bytes' worth),
    padded with zero rows. why: the weight gradients contract over each expert's token rows, and CUDA's grouped GEMM
    needs every group there 16-byte aligned (torchtitan pads its token groups for the same reason). The buffer has
    a fixed size, N plus E*(align-1) rows, so no count travels to the host. The last offset is P: the rows past the
    last expert's own (zeros) belong to it, so that every output row is written. why: `_grouped_mm` leaves rows past
    the last offset uninitialised in its output and in autograd's dX (pytorch#193633); nothing reads them here, but
    a NaN computed there would trip anomaly detection.
    """
    M, K = expert_MK.shape
    expert_N = _flat(expert_MK, slot_N)
    slot_N = torch.arange(M * K, device=expert_MK.device) if slot_N is None else slot_N
    N = expert_N.numel()
    order_N = expert_N.argsort(stable=True)
    counts_E = expert_counts(expert_N, E)
    padded_E = (counts_E + align - 1) // align * align
    pad_end_E = padded_E.cumsum(0)
    sorted_N = expert_N.index_select(0, order_N)
    rank_N = torch.arange(N, device=expert_MK.device) - (counts_E.cumsum(0) - counts_E).index_select(0, sorted_N)
    row_N = (pad_end_E - padded_E).index_select(0, sorted_N) + rank_N  # each sorted slot's row in the buffer
    P = N + E * (align - 1)
    smap = slot_map(slot_N.index_select(0, order_N), row_N, M, K, P, complete=N == M * K)
    # why a device-side fill and not `offs[-1] = P`: writing a Python int into a CUDA tensor waits for the host
    offs = torch.cat((pad_end_E[:-1], pad_end_E.new_full((1,), P))).to(torch.int32)
    return smap, offs
