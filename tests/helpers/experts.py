"""Routed batches and the expert paths' outputs and gradients, for the expert-compute tests."""

from __future__ import annotations

import torch

from moe_lm.model import Experts


def routed_batch(T, E, K, unused=(), dtype=torch.float64):
    allowed = torch.tensor([e for e in range(E) if e not in unused])
    idx = torch.stack([allowed[torch.randperm(len(allowed))[:K]] for _ in range(T)])
    x = torch.randn(T, 16, dtype=dtype, requires_grad=True)
    w = torch.rand(T, K, dtype=dtype, requires_grad=True)
    return x, idx, w


def with_impl(experts: Experts, impl: str) -> Experts:
    """The same experts (same weights, dtype and device) on another path."""
    E, two_i, D = experts.gate_up_proj.shape
    twin = Experts(E, D, two_i // 2, impl).to(experts.gate_up_proj)
    twin.load_state_dict(experts.state_dict())
    return twin


def run(experts, impl, x, idx, w, grad):
    """Outputs and gradients (y, dx, dw, d_gate_up, d_down) of `experts`' weights on the `impl` path."""
    experts = with_impl(experts, impl)
    x.grad = w.grad = None
    y = experts(x, idx, w)
    y.backward(grad)
    return [y.detach(), x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad]


def slot_table(rows: list[int], expert: list[int], w: torch.Tensor, M: int):
    """Slots given one by one (row, expert, weight) as the expert paths take them: (expert [M, K] with -1 where a
    row has fewer slots, w [M, K], the slots' flat ids m * K + k), K the most slots of a row."""
    K = max(rows.count(r) for r in set(rows))
    expert_MK = torch.full((M, K), -1, dtype=torch.int64)
    w_MK = w.new_zeros(M, K)
    slot_N, used = [], [0] * M
    for r, e, wn in zip(rows, expert, w, strict=True):
        expert_MK[r, used[r]], w_MK[r, used[r]] = e, wn
        slot_N.append(r * K + used[r])
        used[r] += 1
    return expert_MK, w_MK, torch.tensor(slot_N)
