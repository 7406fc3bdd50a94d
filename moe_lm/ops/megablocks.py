"""The `megablocks` expert backend (CUDA only): MegaBlocks' dropless kernels, driven by our router's decisions.

Shape legend: M = rows of x, T = rows handed to the kernels, D = model dim, I = expert width, E = (local) experts,
K = slots per row, N = token-slots.

What is MegaBlocks' here: the body of its dMoE with `mlp_impl="grouped"` - `ops.sort` and `ops.histogram` bin the
token-slots by expert, `ops.gather` permutes the rows into expert order, grouped GEMMs (`grouped_gemm.ops.gmm`,
the kernel behind MegaBlocks' GroupedMLP) run the SwiGLU of every expert, and `ops.scatter` un-permutes and sums
each token's K outputs scaled by its gate weights (its backward gives the gate-weight gradient, so the router
learns through it). What is not: MegaBlocks' router, its load-balancing loss and its `ParallelDroplessMLP`
parameters. Our router stays the single source of truth, and the weights stay our stacked gate_up_proj
[E, 2I, D] / down_proj [E, D, I] tensors, which `gmm(..., trans_b=True)` takes as they are; so checkpoints,
expert-parallel sharding and HF export do not depend on the backend, and MegaBlocks' expert-parallel gradient
scaling (`scale_grad`, 1/ep_size) never applies: DeepSpeed reduces expert gradients over the expert-data-parallel
group, unscaled (docs/deepspeed.md §2).

Installed as an optional GPU extra, never a dependency (it pins an old torch and builds only with CUDA); see the
README. Imported on first use.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import torch

from moe_lm.ops import swiglu

INSTALL_HINT = (
    "on a CUDA machine: pip install --no-deps --no-build-isolation megablocks==0.10.0 stanford-stk==0.7.1 "
    "grouped_gemm==0.3.0 (or `make megablocks`)"
)


class BackendUnavailable(RuntimeError):
    """The selected expert backend cannot run on this machine; the message says what is missing."""


@functools.cache  # failures are not cached: an error is raised anew on each call
def load_megablocks() -> SimpleNamespace:
    """MegaBlocks' ops and the grouped GEMM, imported on first use, or a clear error naming what is missing."""
    if not torch.cuda.is_available():
        raise BackendUnavailable(
            f"model.moe.experts_impl='megablocks' needs a CUDA GPU, and torch {torch.__version__} sees none "
            "(torch.cuda.is_available() is False). Use experts_impl='grouped' on this machine: same weights, "
            "same results."
        )
    try:
        import megablocks.ops as mb_ops
    except ImportError as e:
        raise BackendUnavailable(
            f"model.moe.experts_impl='megablocks' needs the megablocks package, which does not import ({e}). "
            f"Install it {INSTALL_HINT}, or use experts_impl='grouped'."
        ) from e
    try:
        import grouped_gemm.ops as gg_ops
    except ImportError as e:
        raise BackendUnavailable(
            f"model.moe.experts_impl='megablocks' needs MegaBlocks' grouped GEMM (package grouped_gemm), which does "
            f"not import ({e}). Install it {INSTALL_HINT}."
        ) from e
    return SimpleNamespace(ops=mb_ops, gmm=gg_ops.gmm)


def megablocks_experts(x_MD, expert_MK, w_MK, gate_up_EFD, down_EDI, slot_N=None) -> torch.Tensor:
    """The expert path: y[m] = sum_k w[m, k] * Expert_{expert[m, k]}(x[m]) through MegaBlocks' kernels, over the
    slots slot_N (None: every slot)."""
    if not x_MD.is_cuda:
        raise RuntimeError(
            f"experts_impl='megablocks' runs on CUDA tensors, got {x_MD.device}: move the model to the GPU, "
            "or use experts_impl='grouped' (same weights)"
        )
    if x_MD.dtype != torch.bfloat16 or gate_up_EFD.dtype != torch.bfloat16:
        raise RuntimeError(
            f"experts_impl='megablocks' runs in bf16 (MegaBlocks' grouped GEMM), got activations "
            f"{x_MD.dtype} and weights {gate_up_EFD.dtype}: train with parallel.dtype=bf16 (the GPU "
            "default), or use experts_impl='grouped'"
        )
    return slots_through(load_megablocks(), x_MD, expert_MK, w_MK, gate_up_EFD, down_EDI, slot_N)


def slots_through(backend, x_MD, expert_MK, w_MK, gate_up_EFD, down_EDI, slot_N=None) -> torch.Tensor:
    """`megablocks_experts` on a given backend (MegaBlocks' ops, or stand-ins in the tests). Every slot: K rows a
    token, MegaBlocks' own form. Some slots (expert parallelism: a received row's slots on this rank's experts vary
    in number, while MegaBlocks' kernels take a fixed K per row): one kernel row per slot, gathered once and summed
    back per row."""
    if slot_N is None:
        return dmoe(backend, x_MD, expert_MK, w_MK, gate_up_EFD, down_EDI)
    K = expert_MK.shape[1]
    rows_N = slot_N // K
    expert_N, w_N = expert_MK.flatten().index_select(0, slot_N), w_MK.flatten().index_select(0, slot_N)
    y_ND = dmoe(backend, x_MD.index_select(0, rows_N), expert_N[:, None], w_N[:, None], gate_up_EFD, down_EDI)
    return x_MD.new_zeros(x_MD.shape).index_add(0, rows_N, y_ND)


def dmoe(
    backend: SimpleNamespace,
    x_TD: torch.Tensor,
    idx_TK: torch.Tensor,
    w_TK: torch.Tensor,
    gate_up_EFD: torch.Tensor,
    down_EDI: torch.Tensor,
) -> torch.Tensor:
    """y[t] = sum_k w[t,k] * Expert_{idx[t,k]}(x[t]) through MegaBlocks' kernels: x [T, D] -> y [T, D]."""
    ops = backend.ops
    T, K = idx_TK.shape
    E = gate_up_EFD.shape[0]
    with torch.no_grad():
        # MegaBlocks' indices_and_bins: slots sorted by expert (its radix sort needs the bit width of E).
        expert_N = idx_TK.flatten().int()
        bin_ids, indices = ops.sort(expert_N, max(math.ceil(math.log2(E)), 1))
        tokens_per_expert = ops.histogram(expert_N, E)
        bins = ops.inclusive_cumsum(tokens_per_expert, 0).view(-1)
        # The grouped GEMM takes the group sizes on the host.
        batch_sizes = tokens_per_expert.cpu().to(torch.long)
    x_ND = ops.gather(x_TD, indices, bin_ids, bins, K)
    a_NI = swiglu(backend.gmm(x_ND, gate_up_EFD, batch_sizes, trans_b=True))
    y_ND = backend.gmm(a_NI, down_EDI, batch_sizes, trans_b=True)
    return ops.scatter(y_ND, indices, bin_ids, w_TK.flatten().to(x_TD.dtype), bins, K)
