"""Compute primitives and backends for the routed experts: what `moe_lm/model/` calls, never the other way round.

    grouped.py       the "grouped" expert path: slots sorted by expert, then segments (CUDA: torch._grouped_mm)
    segment_mlp.py   the CPU segments: the compiled kernel, or per-expert PyTorch matmuls where it cannot run
    cpu_kernels.py   builds and loads csrc/ (the segment kernel and the router's top-k kernel)
    megablocks.py    the "megablocks" expert path: MegaBlocks' dropless kernels (CUDA, optional extra)
    slot_rows.py     token rows into a buffer of slots and back, by gathers only (no atomics: deterministic)

Every expert path has one signature, `fn(x [M, D], expert [M, K], w [M, K], gate_up [E, 2I, D], down [E, D, I],
slot_N [N] or None) -> y [M, D]` with y[m] = sum over the computed slots (m, k) of w[m, k] *
Expert_{expert[m, k]}(x[m]) (slot_N: their flat ids m * K + k; None: every slot); `moe_lm.model.experts` picks one
at construction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused [..., 2I] gate/up projection (gate first, HF's expert layout)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def expert_counts(idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many entries of idx (any shape, values in 0..E-1) name each expert: int64 [E].

    why not torch.bincount: on CUDA it synchronises with the host twice per call (it reads the input's min and max
    to size its output); a scatter-add into a fixed-size vector never does, and it also works under torch.compile.
    """
    flat = idx.flatten()
    return torch.zeros(n_experts, dtype=torch.int64, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))
