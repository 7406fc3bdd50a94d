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
