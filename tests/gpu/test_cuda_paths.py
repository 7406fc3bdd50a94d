"""CUDA paths (skipped without a GPU; `make gpu-check` runs them): bf16 expert paths against the loop, routing
without host synchronisation, fp32 buffers under bf16, MLA's attention backend against the math one, and the
ranks' agreed flag under NCCL (the ZeRO-2 bf16 training run itself is the check's `train` step)."""

from __future__ import annotations

import pytest
import torch

from moe_lm.model import Experts, Transformer
from moe_lm.testing import replace_moe, tiny_model_cfg

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_grouped_mm_equals_loop_with_idle_experts_and_one_expert_holding_everything():
    torch.manual_seed(0)
    E, T, D, I = 16, 300, 256, 128
    loop = Experts(E, D, I, "loop").cuda().bfloat16()
    grouped = Experts(E, D, I, "grouped").cuda().bfloat16()
    grouped.load_state_dict(loop.state_dict())
    for idx in (torch.randint(0, 4, (T, 2)), torch.zeros(T, 1, dtype=torch.long)):  # 12 idle experts; one expert
        idx = idx.cuda()
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(idx.shape, device="cuda")
        torch.testing.assert_close(grouped(x, idx, w).float(), loop(x, idx, w).float(), rtol=2e-2, atol=2e-2)


def test_grouped_mm_backward_stays_finite_after_the_allocator_recycles_nan_memory():
    """pytorch#193633: rows past the last offset were left uninitialised; poison the cache and run backward twice."""
    torch.manual_seed(0)
    experts = Experts(8, 256, 128, "grouped").cuda().bfloat16()
    for _ in range(3):
        junk = torch.full((1 << 22,), float("nan"), device="cuda", dtype=torch.bfloat16)
        del junk
        x = torch.randn(200, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        experts(x, torch.randint(0, 8, (200, 2), device="cuda"), torch.rand(200, 2, device="cuda")).sum().backward()
        assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in experts.parameters())


def test_grouped_experts_give_bitwise_equal_gradients_twice():
    """The rows move by gathers only (moe_lm/ops/slot_rows.py): two identical steps give the same bits. With
    index_add's atomics (the path before) the bf16 sums depended on the order threads landed in."""
    torch.manual_seed(0)
    E, T, D, I, K = 16, 4096, 256, 128, 4
    experts = Experts(E, D, I, "grouped").cuda().bfloat16()
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda()
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(T, K, device="cuda", requires_grad=True)
    grads = []
    for _ in range(2):
        x.grad = w.grad = None
        experts.zero_grad(set_to_none=True)
        experts(x, idx, w).float().square().sum().backward()
        grads.append([x.grad.clone(), w.grad.clone(), *(p.grad.clone() for p in experts.parameters())])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_routing_and_grouped_experts_never_synchronise_with_the_host():
    model = Transformer(replace_moe(tiny_model_cfg(), experts_impl="grouped")).cuda().bfloat16().train()
    tokens = torch.randint(0, 97, (2, 32), device="cuda")
    model(tokens)  # warm-up (lazy initialisation may synchronise)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for moe in model.moe_layers():
            x = torch.randn(64, model.cfg.dim, device="cuda", dtype=torch.bfloat16)
            moe(x[None])
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_bf16_model_keeps_rope_frequencies_and_router_bias_in_fp32():
    model = Transformer(tiny_model_cfg()).cuda().bfloat16()
    assert model.inv_freq.dtype == torch.float32 and model.inv_freq.is_cuda
    assert all(r.e_score_correction_bias.dtype == torch.float32 for r in model.routers())


@pytest.mark.parametrize("rope, nope, v", [(64, 128, 128), (32, 96, 128)])
def test_mla_attention_backend_matches_the_math_backend(rope, nope, v):
    """MLA's q/k head dim (nope + rope) differs from v's: which SDPA backend runs, and does it agree with math."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    B, H, S = 2, 16, 1024
    q = torch.randn(B, H, S, nope + rope, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, H, S, nope + rope, device="cuda", dtype=torch.bfloat16)
    v_ = torch.randn(B, H, S, v, device="cuda", dtype=torch.bfloat16)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v_, is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v_.float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_ranks_agree_under_nccl():
    """The first GPU run's training stopped at its first collective: the agreed flag was a CPU tensor, which NCCL
    refuses ("No backend type associated with device type cpu"). A one-rank NCCL group runs on one GPU."""
    import torch.distributed as dist

    from moe_lm.checkpoint.save_resume import everywhere

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert everywhere(True) is True and everywhere(False) is False
    finally:
        dist.destroy_process_group()
