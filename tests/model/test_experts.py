"""Expert compute paths: the fast "grouped" path equals the "loop" reference in outputs and all gradients."""

from __future__ import annotations

import pytest
import torch

from moe_lm.model import Experts
from moe_lm.model.experts import SegmentMLP, grouped_mm_experts


def routed_batch(T, E, K, unused=(), dtype=torch.float64):
    allowed = torch.tensor([e for e in range(E) if e not in unused])
    idx = torch.stack([allowed[torch.randperm(len(allowed))[:K]] for _ in range(T)])
    x = torch.randn(T, 16, dtype=dtype, requires_grad=True)
    w = torch.rand(T, K, dtype=dtype, requires_grad=True)
    return x, idx, w


def run(experts, impl, x, idx, w, grad):
    experts.impl = impl
    experts.zero_grad(set_to_none=True)
    x.grad = w.grad = None
    y = experts(x, idx, w)
    y.backward(grad)
    return [y.detach(), x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad]


@pytest.mark.parametrize("E, K", [(4, 1), (8, 2), (16, 5)])
def test_grouped_equals_loop_with_idle_experts(E, K):
    experts = Experts(E, 16, 12).double()
    x, idx, w = routed_batch(40, E, K, unused=(1, E - 1))
    grad = torch.randn(40, 16, dtype=torch.float64)
    ref = run(experts, "loop", x, idx, w, grad)
    fast = run(experts, "grouped", x, idx, w, grad)
    for name, a, b in zip(["y", "dx", "dw", "d_gate_up", "d_down"], fast, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10, msg=name)
    for e in (1, E - 1):  # experts that received no token get exactly zero gradient
        assert fast[3][e].abs().sum() == 0 and fast[4][e].abs().sum() == 0


def test_grouped_matches_in_fp32():
    experts = Experts(8, 16, 12)
    x, idx, w = routed_batch(64, 8, 2, dtype=torch.float32)
    grad = torch.randn(64, 16)
    for a, b in zip(run(experts, "grouped", x, idx, w, grad), run(experts, "loop", x, idx, w, grad), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_slots_entry_point(impl):
    """forward_slots (what an expert-parallel dispatcher calls) equals running each slot's expert directly."""
    experts = Experts(4, 16, 12, impl).double()
    x = torch.randn(6, 16, dtype=torch.float64)
    rows = torch.tensor([0, 0, 2, 5, 5, 5, 3])
    expert = torch.tensor([1, 3, 0, 0, 2, 3, 3])
    w = torch.rand(7, dtype=torch.float64)
    y = experts.forward_slots(x, rows, expert, w)
    ref = torch.zeros_like(x)
    for r, e, wn in zip(rows.tolist(), expert.tolist(), w, strict=True):
        g, u = (x[r] @ experts.gate_up_proj[e].T).chunk(2, -1)
        ref[r] += wn * ((torch.nn.functional.silu(g) * u) @ experts.down_proj[e].T)
    torch.testing.assert_close(y, ref)


def test_grouped_mm_kernel_matches_cpu_kernel():
    """The CUDA route (torch._grouped_mm, groups padded to 16-byte starts) checked on CPU against SegmentMLP."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not in this torch build")
    E, D, I = 4, 16, 8
    counts = torch.tensor([5, 0, 7, 4])  # fp32 aligns groups to 4 rows: experts 0 and 2 get padding rows
    x = torch.randn(20, D, requires_grad=True)  # rows 16.. are never routed
    token = torch.randperm(20)[:16]
    w = torch.rand(16, requires_grad=True)
    gu = torch.randn(E, 2 * I, D, requires_grad=True)
    dn = torch.randn(E, D, I, requires_grad=True)
    grad = torch.randn(20, D)
    outs = []
    for fn in (
        lambda: grouped_mm_experts(x, token, counts, w, gu, dn),
        lambda: SegmentMLP.apply(x, token, counts, w, gu, dn),
    ):
        for t in (x, w, gu, dn):
            t.grad = None
        y = fn()
        y.backward(grad)
        outs.append([y.detach(), x.grad, w.grad, gu.grad, dn.grad])
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_no_token_dropped_at_extreme_imbalance():
    """Dropless: every token reaches its experts even when all of them pick the same ones."""
    experts = Experts(8, 16, 12).double()
    x = torch.randn(100, 16, dtype=torch.float64)
    idx = torch.tensor([[3, 5]]).repeat(100, 1)
    w = torch.ones(100, 2, dtype=torch.float64)
    experts.impl = "grouped"
    y = experts(x, idx, w)
    experts.impl = "loop"
    torch.testing.assert_close(y, experts(x, idx, w))
    assert y.abs().sum(-1).gt(0).all()
