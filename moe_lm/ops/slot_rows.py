"""Token rows moved into a buffer of slots and back, by gathers in both directions: no scatter-add.

Shape legend: M = token rows, K = slots per row, P = buffer rows, D = features.

A `SlotMap` says where each row's slots sit in a buffer, in both directions:
    table_MK [M, K]   the buffer row of row m's k-th slot (P: that slot is not in the buffer)
    slot_P   [P]      the slot m * K + k each buffer row holds (M * K: a padding row, holding none)
and the two moves, each a gather through one map, forward and backward:
    gather_slots(x_MD, map)          buf[p] = x[slot_P[p] // K]                 dx[m] = sum_k g[table[m, k]]
    combine_slots(y_PD, map, w_MK)   out[m] = sum_k w[m, k] * y[table[m, k]]    dy[p] = w[slot] * g[slot // K]
                                                                                dw[m, k] = <y[table[m, k]], g[m]>

why: the index_select / index_add pair these replace accumulates each token's K rows with atomics on a GPU; the
result then depends on the order threads land in (two identical steps gave different gradients), and in bf16 those
atomics were a tenth of a gpu_1b step (docs/gpu.md). Here every output row is one reduction over its K slots (a sum,
or a batched product with the weights), accumulated in float32, and each buffer row is written by one gather.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SlotMap(NamedTuple):
    table_MK: torch.Tensor  # int64 [M, K]: buffer row of each slot, P where the slot is not in the buffer
    slot_P: torch.Tensor  # int64 [P]: slot of each buffer row, M * K for padding
    complete: bool  # every slot is in the buffer (no P in table_MK): the masks are skipped


def slot_map(slot_N: torch.Tensor, row_N: torch.Tensor, M: int, K: int, P: int, complete: bool) -> SlotMap:
    """The map of N slots (flat ids m * K + k, each once) placed at buffer rows row_N (each once) in a buffer of P
    rows. why scatters here: they write distinct indices, once each (no accumulation), and only integers."""
    table = torch.full((M * K,), P, dtype=torch.int64, device=slot_N.device).scatter_(0, slot_N, row_N)
    slot_P = torch.full((P,), M * K, dtype=torch.int64, device=slot_N.device).scatter_(0, row_N, slot_N)
    return SlotMap(table.view(M, K), slot_P, complete)


def gather_slots(x_MD: torch.Tensor, smap: SlotMap) -> torch.Tensor:
    """The buffer [P, D]: each buffer row a copy of its slot's row of x (zeros for padding)."""
    return _GatherSlots.apply(x_MD, smap.table_MK, smap.slot_P, smap.complete)


def combine_slots(y_PD: torch.Tensor, smap: SlotMap, w_MK: torch.Tensor | None = None) -> torch.Tensor:
    """[M, D]: each row's slots' buffer rows summed in float32, weighted by w_MK (None: weight 1); y's dtype."""
    return _CombineSlots.apply(y_PD, w_MK, smap.table_MK, smap.slot_P, smap.complete)


def _rows_of(a_PD: torch.Tensor, rows: torch.Tensor, complete: bool) -> torch.Tensor:
    """a[rows] with rows past the end (a slot not in the buffer) as zeros."""
    if complete:
        return a_PD.index_select(0, rows)
    got = a_PD.index_select(0, rows.clamp(max=a_PD.shape[0] - 1))
    return torch.where((rows < a_PD.shape[0])[:, None], got, 0)


def _by_slot(a_PD: torch.Tensor, table_MK: torch.Tensor, complete: bool) -> torch.Tensor:
    """[M, K, D]: each row's slots' buffer rows (zeros for a slot not in the buffer)."""
    M, K = table_MK.shape
    return _rows_of(a_PD, table_MK.flatten(), complete).view(M, K, -1)


class _GatherSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD, table_MK, slot_P, complete):
        ctx.save_for_backward(table_MK)
        ctx.complete = complete
        K = table_MK.shape[1]
        return _rows_of(x_MD, slot_P // K, False)  # padding rows (slot M * K) come out as zeros

    @staticmethod
    def backward(ctx, g_PD):
        (table_MK,) = ctx.saved_tensors
        # why sum(dtype=): the K rows of each token added in float32 (float64 rows in float64), rounded once
        dx = _by_slot(g_PD, table_MK, ctx.complete).sum(1, dtype=torch.promote_types(g_PD.dtype, torch.float32))
        return dx.to(g_PD.dtype), None, None, None


class _CombineSlots(torch.autograd.Function):
    """out[m] = sum_k w[m, k] * y[table[m, k]] as one batched product [M, 1, K] @ [M, K, D], which accumulates in
    float32 for bf16 rows (the weights rounded to the rows' dtype, as the scatter-add path multiplied them)."""

    @staticmethod
    def forward(ctx, y_PD, w_MK, table_MK, slot_P, complete):
        ctx.save_for_backward(y_PD, w_MK, table_MK, slot_P)
        ctx.complete = complete
        y_MKD = _by_slot(y_PD, table_MK, complete)
        if w_MK is None:
            return y_MKD.sum(1, dtype=torch.promote_types(y_PD.dtype, torch.float32)).to(y_PD.dtype)
        return torch.bmm(w_MK.to(y_PD.dtype)[:, None, :], y_MKD).squeeze(1)

    @staticmethod
    def backward(ctx, g_MD):
        y_PD, w_MK, table_MK, slot_P = ctx.saved_tensors
        M, K = table_MK.shape
        dy = dw = None
        if ctx.needs_input_grad[0]:  # each buffer row: its slot's weight times its row's gradient
            dy = _rows_of(g_MD, slot_P // K, False)
            if w_MK is not None:
                dy = dy * _rows_of(w_MK.reshape(M * K, 1), slot_P, False).to(dy.dtype)
        if w_MK is not None and ctx.needs_input_grad[1]:  # dw[m, k] = <y[table[m, k]], g[m]>
            dw = torch.bmm(_by_slot(y_PD, table_MK, ctx.complete), g_MD[:, :, None]).squeeze(2).to(w_MK.dtype)
        return dy, dw, None, None, None
