"""The training step's paths as they were before issue 65's speed work, kept for the benchmarks only: a model's
modules switched back (`switch_back`), so that one interleaved run times today's step against each change (the GPU
check's `speed` step). Never used in training.

- dispatch: the CUDA expert path's rows moved into the padded buffer with index_copy and back with a bf16
  index_add, weighted before the down projection (atomics on a GPU: not deterministic);
- attention: MLA's query and key built by concatenating their rope and nope parts on every call, v padded to the
  query's width on every device, whatever kernel PyTorch then chose.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from moe_lm.model.attention import MLA, apply_rope
from moe_lm.model.experts import Experts
from moe_lm.ops import expert_counts, swiglu

CHANGES = ("dispatch", "attention")


def switch_back(model: torch.nn.Module, changes: tuple[str, ...]) -> torch.nn.Module:
    """`model` with the named changes undone in place (before any torch.compile): "dispatch", "attention"."""
    unknown = set(changes) - set(CHANGES)
    if unknown:
        raise ValueError(f"no such change {sorted(unknown)}: one of {CHANGES}")
    for module in model.modules():
        if "dispatch" in changes and isinstance(module, Experts) and module.impl == "grouped":
            module.path = scatter_add_grouped
        if "attention" in changes and isinstance(module, MLA):
            module.forward = types.MethodType(concatenating_forward, module)
    return model


def scatter_add_grouped(x_MD, expert_MK, w_MK, gate_up_EFD, down_EDI, slot_N=None) -> torch.Tensor:
    """The "grouped" path before: on CUDA `torch._grouped_mm` with index_copy / index_add (on the CPU today's
    kernel: it had no atomics to remove)."""
    from moe_lm.ops.grouped import grouped_experts

    if not (x_MD.is_cuda and hasattr(torch, "_grouped_mm")):
        return grouped_experts(x_MD, expert_MK, w_MK, gate_up_EFD, down_EDI, slot_N)
    return scatter_add_mm(x_MD, expert_MK, w_MK, gate_up_EFD, down_EDI, slot_N)


def scatter_add_mm(x_MD, expert_MK, w_MK, gate_up_EFD, down_EDI, slot_N=None) -> torch.Tensor:
    """`torch._grouped_mm` over the padded buffer, filled by index_copy and summed back by index_add."""
    K = expert_MK.shape[1]
    slot_N = torch.arange(expert_MK.numel(), device=x_MD.device) if slot_N is None else slot_N
    expert_N = expert_MK.flatten().index_select(0, slot_N)
    order_N = expert_N.argsort(stable=True)
    token_N = (slot_N // K).index_select(0, order_N)
    counts_E = expert_counts(expert_N, gate_up_EFD.shape[0])
    w_N = w_MK.flatten().index_select(0, slot_N).index_select(0, order_N).to(x_MD.dtype)
    N, E = token_N.numel(), counts_E.numel()
    align = max(16 // x_MD.element_size(), 1)
    padded_E = (counts_E + align - 1) // align * align
    pad_end_E = padded_E.cumsum(0)
    sorted_N = torch.repeat_interleave(torch.arange(E, device=x_MD.device), counts_E, output_size=N)
    rank_N = torch.arange(N, device=x_MD.device) - (counts_E.cumsum(0) - counts_E)[sorted_N]
    row_N = (pad_end_E - padded_E)[sorted_N] + rank_N
    P = N + E * (align - 1)
    x_PD = x_MD.new_zeros(P, x_MD.shape[1]).index_copy(0, row_N, x_MD.index_select(0, token_N))
    w_P = w_N.new_zeros(P).index_copy(0, row_N, w_N)
    offs = torch.cat((pad_end_E[:-1], pad_end_E.new_full((1,), P))).to(torch.int32)
    a_PI = swiglu(torch._grouped_mm(x_PD, gate_up_EFD.transpose(-2, -1), offs=offs)) * w_P[:, None]
    y_PD = torch._grouped_mm(a_PI, down_EDI.transpose(-2, -1), offs=offs)
    return x_MD.new_zeros(x_MD.shape).index_add(0, token_N, y_PD.index_select(0, row_N))


def concatenating_forward(self: MLA, x_BSD, cos, sin, mask, cache=None) -> torch.Tensor:
    """MLA.forward before: q and k concatenated from their rope and nope parts, v padded to the query's width."""
    B, S, _ = x_BSD.shape
    H = self.n_heads
    q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSD))) if hasattr(self, "q_a_proj") else self.q_proj(x_BSD)
    q_nope, q_rot = q.view(B, S, H, self.nope + self.rope).transpose(1, 2).split([self.nope, self.rope], dim=-1)
    latent, k_rot = self.kv_a_proj_with_mqa(x_BSD).split([self.kv_rank, self.rope], dim=-1)
    latent = self.kv_a_layernorm(latent)
    k_rot = apply_rope(k_rot.view(B, 1, S, self.rope), cos, sin)
    if cache is not None:
        latent, k_rot = cache.extend(self.layer_id, latent, k_rot)
    L = latent.shape[1]
    kv = self.kv_b_proj(latent).view(B, L, H, self.nope + self.v_dim).transpose(1, 2)
    k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
    q = torch.cat((q_nope, apply_rope(q_rot, cos, sin)), dim=-1)
    k = torch.cat((k_nope, k_rot.expand(B, H, L, self.rope)), dim=-1)
    width = max(self.nope + self.rope, self.v_dim) if S > 1 else 0
    q, k, v = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t for t in (q, k, v))
    out = self.sdpa(q, k, v, mask, self.scale)[..., : self.v_dim]
    return self.o_proj(out.transpose(1, 2).reshape(B, S, H * self.v_dim))
