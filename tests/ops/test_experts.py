"""Expert compute paths: the fast "grouped" path equals the "loop" reference in outputs and all gradients.

The grouped path runs on CPU as the compiled kernel (fp32) or as the PyTorch `SegmentMLP` (other dtypes, or
when the kernel is off); both are checked here against the loop.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch

from moe_lm.model import Experts
from moe_lm.model.experts import loop_experts
from moe_lm.ops import cpu_kernels as ck
from moe_lm.ops.cpu_kernels import load_cpu_kernels
from moe_lm.ops.grouped import grouped_mm
from moe_lm.ops.segment_mlp import SegmentMLPKernel
from tests.helpers.experts import routed_batch, run, slot_table, with_impl


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
    y = experts.forward_slots(x, *slot_table(rows.tolist(), expert.tolist(), w, 6))
    ref = torch.zeros_like(x)
    for r, e, wn in zip(rows.tolist(), expert.tolist(), w, strict=True):
        g, u = (x[r] @ experts.gate_up_proj[e].T).chunk(2, -1)
        ref[r] += wn * ((torch.nn.functional.silu(g) * u) @ experts.down_proj[e].T)
    torch.testing.assert_close(y, ref)


@pytest.mark.parametrize("every_slot", [True, False])
def test_grouped_mm_equals_loop(every_slot):
    """The CUDA route (torch._grouped_mm, groups padded to 16-byte starts, rows moved by gathers only) checked on CPU
    against the loop reference, outputs and every gradient: every slot of each token (one device), and some slots of
    some rows with idle experts and rows with no slot (what an expert-parallel dispatcher hands over)."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not in this torch build")
    torch.manual_seed(0)
    E, D, I, M, K = 4, 16, 8, 20, 3  # fp32 aligns groups to 4 rows: most experts get padding rows
    expert = torch.stack([torch.randperm(E)[:K] for _ in range(M)])
    slot_N = None
    if not every_slot:  # rows 16.. have no slot, expert 1 none at all
        slot_N = torch.tensor([n for n in range(16 * K) if expert.flatten()[n] != 1 and n % 5 != 2])
        expert = expert.flatten().index_fill(0, torch.tensor([n for n in range(M * K) if n not in slot_N]), -1)
        expert = expert.view(M, K)
    x = torch.randn(M, D, requires_grad=True)
    w = torch.rand(M, K, requires_grad=True)
    gu = torch.randn(E, 2 * I, D, requires_grad=True)
    dn = torch.randn(E, D, I, requires_grad=True)
    grad = torch.randn(M, D)
    outs = []
    for fn in (grouped_mm, loop_experts):
        for t in (x, w, gu, dn):
            t.grad = None
        y = fn(x, expert, w, gu, dn, slot_N)
        y.backward(grad)
        outs.append([y.detach(), x.grad, w.grad, gu.grad, dn.grad])
    for name, a, b in zip(["y", "dx", "dw", "d_gate_up", "d_down"], *outs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=name)
    if not every_slot:
        assert gu.grad[1].abs().sum() == 0 and x.grad[16:].abs().sum() == 0 and w.grad[expert < 0].abs().sum() == 0


def test_no_token_dropped_at_extreme_imbalance():
    """Dropless: every token reaches its experts even when all of them pick the same ones."""
    experts = Experts(8, 16, 12).double()
    x = torch.randn(100, 16, dtype=torch.float64)
    idx = torch.tensor([[3, 5]]).repeat(100, 1)
    w = torch.ones(100, 2, dtype=torch.float64)
    y = experts(x, idx, w)
    torch.testing.assert_close(y, with_impl(experts, "loop")(x, idx, w))
    assert y.abs().sum(-1).gt(0).all()


# ---- the compiled CPU kernel -------------------------------------------------------------------------------------

KERNEL_EXPECTED = sys.platform.startswith("linux") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def kernel():
    if os.environ.get(ck.KERNEL_ENV) == "0" or not KERNEL_EXPECTED:
        pytest.skip("the compiled CPU kernel is switched off or not built on this platform")
    module = load_cpu_kernels()
    assert module is not None, "the CPU expert kernel failed to build here (see the warning): g++ and ninja needed"
    return module


def kernel_vs_loop(T, E, K, idx=None, D=24, I=20, threads=None):
    """Kernel outputs and gradients against the loop path in float64 on the same weights."""
    torch.manual_seed(0)
    experts = Experts(E, D, I)
    if idx is None:
        idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    x, w = torch.randn(T, D), torch.rand(T, K)
    grad = torch.randn(T, D)
    ref = run(experts.double(), "loop", x.double().requires_grad_(), idx, w.double().requires_grad_(), grad.double())
    experts.float()
    old = torch.get_num_threads()
    try:
        if threads:
            torch.set_num_threads(threads)
        got = run(experts, "grouped", x.requires_grad_(), idx, w.requires_grad_(), grad)
    finally:
        torch.set_num_threads(old)
    for name, a, b in zip(["y", "dx", "dw", "d_gate_up", "d_down"], got, ref, strict=True):
        torch.testing.assert_close(a, b.float(), atol=2e-5, rtol=1e-4, msg=name)
    return got


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("E, K", [(4, 1), (8, 2), (16, 5)])
def test_kernel_equals_loop(E, K, threads):
    kernel()
    kernel_vs_loop(96, E, K, threads=threads)


def test_kernel_splits_work_over_threads_only_when_balanced():
    module = kernel()
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        plan = module.segment_mlp_plan
        assert plan(torch.tensor([10, 10, 10, 10])) == [[0, 2], [1, 3]]
        assert plan(torch.tensor([30, 10, 0, 10, 10])) == [[0], [1, 3, 4]]  # idle expert 2 has no item
        assert plan(torch.tensor([50, 5, 5])) == [[0, 1, 2]]  # a 2-way split would idle a thread
        torch.set_num_threads(1)
        assert plan(torch.tensor([10, 10])) == [[0, 1]]
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_both_schedules_with_idle_and_skewed_experts(threads):
    """Balanced counts run experts on separate threads, skewed ones in turn; idle experts get zero gradient."""
    kernel()
    T, E = 64, 6
    balanced = torch.stack([torch.tensor([0, 3]), torch.tensor([4, 5])]).repeat(T // 2, 1)
    skewed = torch.tensor([[1, 0]]).repeat(T, 1)
    skewed[:4, 1] = 2
    for idx in (balanced, skewed):
        got = kernel_vs_loop(T, E, 2, idx=idx, threads=threads)
        for e in set(range(E)) - set(idx.flatten().tolist()):
            assert got[3][e].abs().sum() == 0 and got[4][e].abs().sum() == 0


def test_kernel_row_repeated_within_an_expert():
    """forward_slots may hand one row to one expert twice; the kernel's scatter-add must sum both."""
    kernel()
    experts = Experts(3, 16, 8)
    x = torch.randn(4, 16)
    slots = slot_table([1, 1, 2, 1, 0], [2, 2, 2, 0, 0], torch.rand(5), 4)
    ref = Experts(3, 16, 8, "loop")
    ref.load_state_dict(experts.state_dict())
    torch.testing.assert_close(experts.forward_slots(x, *slots), ref.forward_slots(x, *slots))


def test_kernel_rejects_bad_slots():
    kernel()
    x, gu, dn = torch.randn(4, 8), torch.randn(2, 6, 8), torch.randn(2, 8, 3)
    w = torch.ones(3)
    with pytest.raises(RuntimeError, match="out of range"):
        SegmentMLPKernel.apply(x, torch.tensor([0, 9, 1]), torch.tensor([2, 1]), w, gu, dn)
    with pytest.raises(RuntimeError, match="counts sum to 2"):
        SegmentMLPKernel.apply(x, torch.tensor([0, 1, 1]), torch.tensor([1, 1]), w, gu, dn)


def test_switched_off_kernel_falls_back_to_pytorch(monkeypatch):
    monkeypatch.setenv(ck.KERNEL_ENV, "0")
    load_cpu_kernels.cache_clear()
    try:
        assert load_cpu_kernels() is None
        experts = Experts(4, 16, 12)
        x, idx, w = routed_batch(32, 4, 2, dtype=torch.float32)
        grad = torch.randn(32, 16)
        for a, b in zip(run(experts, "grouped", x, idx, w, grad), run(experts, "loop", x, idx, w, grad), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    finally:
        load_cpu_kernels.cache_clear()


def test_kernel_build_failure_warns_and_falls_back(monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(ck.sys, "platform", "linux")
    monkeypatch.setattr(ck.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    load_cpu_kernels.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="could not build the CPU kernels.*command not found"):
            assert load_cpu_kernels() is None
    finally:
        load_cpu_kernels.cache_clear()


def test_kernel_avx2_build_equals_reference(process):
    """The AVX2 build (most laptops) on this machine, through torch's ATEN_CPU_CAPABILITY override."""
    kernel()  # this machine runs AVX2 or AVX-512 code
    script = textwrap.dedent(
        """
        import torch
        from moe_lm.ops.cpu_kernels import load_cpu_kernels
        from tests.ops.test_experts import kernel_vs_loop
        from tests.model.test_router import kernel_topk_vs_torch
        assert torch.backends.cpu.get_cpu_capability() == "AVX2"
        assert load_cpu_kernels().__name__ == "moe_lm_cpu_kernels_avx2"
        kernel_topk_vs_torch(64, 64, 8, 4, 8)
        kernel_vs_loop(96, 8, 2, threads=2)
        kernel_vs_loop(64, 4, 2, idx=torch.tensor([[1, 0]]).repeat(64, 1))
        print("ok")
        """
    )
    # why a fresh interpreter: torch reads ATEN_CPU_CAPABILITY once, when it starts
    out = process.python(script, env=process.clean_env({"ATEN_CPU_CAPABILITY": "avx2"}))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n_shared", [1, 2])
def test_moe_layer_with_shared_experts_equals_loop_reference(n_shared, threads):
    """The whole MoE layer on the kernel path (fp32): outputs and every gradient (router, shared and routed
    weights, input) equal the loop path in float64."""
    kernel()
    from moe_lm.model import MoE
    from moe_lm.testing import tiny_model_cfg

    moe = dict(n_group=1, topk_group=1, num_experts_per_tok=2, routed_scaling_factor=1.0, moe_inter_dim=12)
    cfg = tiny_model_cfg(dim=24, moe={**moe, "n_shared_experts": n_shared})
    torch.manual_seed(0)
    fused = MoE(cfg).train()
    ref = MoE(tiny_model_cfg(dim=24, moe={**moe, "n_shared_experts": n_shared, "experts_impl": "loop"}))
    ref = ref.double().train()
    ref.load_state_dict(fused.state_dict())
    x = torch.randn(2, 40, 24)
    grad = torch.randn(2, 40, 24)

    def run(moe, x):
        x = x.clone().requires_grad_()
        y, aux = moe(x)
        (y * grad.to(y.dtype)).sum().add(aux).backward()
        return {"y": y.detach(), "dx": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = run(fused, x)
    finally:
        torch.set_num_threads(old)
    want = run(ref, x.double())
    assert set(got) == set(want) and any(k.startswith("shared_experts.") for k in got)
    for k in want:
        torch.testing.assert_close(got[k], want[k].float(), atol=2e-5, rtol=1e-4, msg=k)
