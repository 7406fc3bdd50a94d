"""The gate against HF's DeepseekV3TopkRouter / DeepseekV3MoE, and the invariants of DESIGN §3.2-3.3.

On this CPU the router's choice runs in the compiled kernel (csrc/route_topk.cpp), so the HF parity tests cover
it; the kernel is also held to the PyTorch code directly, including its tie and NaN rules.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter

from moe_lm.model import MoE, Router, update_biases
from moe_lm.model.router import batch_balance_loss, select_experts, select_experts_torch, sequence_balance_loss
from moe_lm.testing import replace_moe, tiny_model_cfg


def hf_config(cfg) -> DeepseekV3Config:
    m = cfg.moe
    return DeepseekV3Config(
        hidden_size=cfg.dim,
        moe_intermediate_size=m.moe_inter_dim,
        n_routed_experts=m.n_routed_experts,
        n_shared_experts=m.n_shared_experts,
        num_experts_per_tok=m.num_experts_per_tok,
        n_group=m.n_group,
        topk_group=m.topk_group,
        routed_scaling_factor=m.routed_scaling_factor,
        norm_topk_prob=m.norm_topk_prob,
        experts_implementation="eager",
    )


def sorted_by_expert(idx, w):
    order = idx.argsort(-1)
    return idx.gather(-1, order), w.gather(-1, order)


GROUPINGS = [dict(n_group=1, topk_group=1), dict(n_group=4, topk_group=2), dict(n_group=8, topk_group=3)]


@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("norm", [True, False])
def test_router_matches_hf(grouping, norm):
    cfg = replace_moe(tiny_model_cfg(), n_routed_experts=16, num_experts_per_tok=4, norm_topk_prob=norm, **grouping)
    ours = Router(cfg.dim, cfg.moe).eval()
    with torch.no_grad():
        ours.e_score_correction_bias.normal_(0.0, 0.05)  # non-zero, partly negative
    hf = DeepseekV3TopkRouter(hf_config(cfg))
    hf.load_state_dict(ours.state_dict())
    x = torch.randn(200, cfg.dim)
    r = ours(x)
    _, hf_w, hf_idx = hf(x)
    a_idx, a_w = sorted_by_expert(r.topk_idx, r.topk_weight)
    b_idx, b_w = sorted_by_expert(hf_idx, hf_w)
    assert torch.equal(a_idx, b_idx)
    torch.testing.assert_close(a_w, b_w, atol=1e-6, rtol=1e-5)
    # and our choices come in rank order: first choice has the highest biased score among the eligible
    biased = r.scores + ours.e_score_correction_bias
    assert (biased.gather(1, r.topk_idx).diff(dim=1) <= 0).all()


@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_moe_layer_matches_hf(grouping, impl):
    cfg = replace_moe(tiny_model_cfg(), n_routed_experts=16, num_experts_per_tok=4, experts_impl=impl, **grouping)
    ours = MoE(cfg).eval()
    with torch.no_grad():
        ours.gate.e_score_correction_bias.normal_(0.0, 0.05)
    hf = DeepseekV3MoE(hf_config(cfg))
    hf.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(3, 40, cfg.dim)
    y, aux = ours(x)
    torch.testing.assert_close(y, hf(x), atol=1e-5, rtol=1e-5)
    assert aux.item() == 0.0  # balance losses are training-only


def test_selected_weights_sum_to_routed_scaling_factor():
    cfg = replace_moe(tiny_model_cfg(), routed_scaling_factor=2.5)
    r = Router(cfg.dim, cfg.moe)(torch.randn(100, cfg.dim))
    torch.testing.assert_close(r.topk_weight.sum(-1), torch.full((100,), 2.5))


def test_constant_bias_shift_changes_no_routing():
    cfg = tiny_model_cfg()
    router = Router(cfg.dim, cfg.moe).eval()
    x = torch.randn(300, cfg.dim)
    with torch.no_grad():
        router.e_score_correction_bias.normal_(0.0, 0.1)
        before = router(x)
        router.e_score_correction_bias += 0.37
        after = router(x)
    assert torch.equal(before.topk_idx, after.topk_idx)
    assert torch.equal(before.topk_weight, after.topk_weight)


def test_huge_bias_puts_expert_in_every_topk():
    cfg = tiny_model_cfg()
    router = Router(cfg.dim, cfg.moe).eval()
    with torch.no_grad():
        router.e_score_correction_bias[5] = 100.0
    r = router(torch.randn(300, cfg.dim))
    assert (r.topk_idx == 5).any(-1).all()
    assert (r.topk_idx[:, 0] == 5).all()  # and it is every token's first choice


def test_bias_never_changes_the_weights_of_a_selection():
    cfg = tiny_model_cfg()
    router = Router(cfg.dim, cfg.moe).eval()
    x = torch.randn(300, cfg.dim)
    with torch.no_grad():
        router.e_score_correction_bias.normal_(0.0, 0.3)
    r = router(x)
    s = r.scores.gather(1, r.topk_idx)
    expected = s / s.sum(-1, keepdim=True) * cfg.moe.routed_scaling_factor  # unbiased scores of the selection
    torch.testing.assert_close(r.topk_weight, expected)
    biased = (r.scores + router.e_score_correction_bias).gather(1, r.topk_idx)
    assert not torch.allclose(r.topk_weight, biased / biased.sum(-1, keepdim=True) * cfg.moe.routed_scaling_factor)


def test_experts_of_masked_groups_are_never_chosen():
    E, G, keep, K = 16, 4, 2, 3
    scores = torch.rand(500, E)
    bias = torch.randn(E) * 0.2
    idx = select_experts(scores, bias, K, G, keep)
    # independent reference: per token, rank groups by the sum of their two best biased scores
    biased = (scores + bias).view(500, G, E // G)
    group_score = biased.sort(-1, descending=True).values[..., :2].sum(-1)
    kept = group_score.argsort(-1, descending=True)[:, :keep]
    chosen_group = idx // (E // G)
    assert (chosen_group[:, :, None] == kept[:, None, :]).any(-1).all()
    # and the -inf mask matters: negative biases would otherwise let a masked expert (score 0) win
    flat = torch.full((4, E), 0.01)
    flat[:, : 2 * E // G] += 0.001  # groups 0 and 1 are best
    neg = select_experts(flat, torch.full((E,), -1.0), K, G, keep)
    assert ((neg // (E // G))[:, :, None] == torch.tensor([0, 1])).any(-1).all()


def test_counts_accumulate_only_in_training_forward():
    cfg = tiny_model_cfg()
    router = Router(cfg.dim, cfg.moe)
    x = torch.randn(50, cfg.dim)
    router.eval()
    router(x)
    assert router.tokens_per_expert.sum() == 0
    router.train()
    r = router(x)
    assert router.tokens_per_expert.sum() == 50 * cfg.moe.num_experts_per_tok
    assert torch.equal(router.tokens_per_expert, torch.bincount(r.topk_idx.flatten(), minlength=8))


def test_counts_once_under_activation_checkpointing():
    cfg = tiny_model_cfg()
    moe = MoE(cfg).train()
    x = torch.randn(2, 10, cfg.dim, requires_grad=True)
    y, _ = torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False)
    y.sum().backward()  # re-runs forward inside backward
    assert moe.gate.tokens_per_expert.sum() == 20 * cfg.moe.num_experts_per_tok


def test_bias_update_rule():
    cfg = tiny_model_cfg()
    routers = [Router(cfg.dim, cfg.moe) for _ in range(2)]
    counts = [torch.tensor([10, 0, 5, 5, 5, 5, 5, 5]), torch.tensor([5] * 8)]
    update_biases(routers, counts, speed=0.001)
    # mean 5: overloaded expert 0 goes down, starved expert 1 goes up, balanced ones stay
    expected = torch.tensor([-0.001, 0.001, 0, 0, 0, 0, 0, 0])
    torch.testing.assert_close(routers[0].e_score_correction_bias, expected)
    assert routers[1].e_score_correction_bias.abs().sum() == 0
    assert routers[0].e_score_correction_bias.dtype == torch.float32


def test_bias_stays_fp32_buffer_under_bf16_cast():
    cfg = tiny_model_cfg()
    moe = MoE(cfg)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.fill_(1e-3 + 1e-6)  # not representable in bf16
    moe = moe.to(torch.bfloat16)
    bias = moe.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias[0].item() == pytest.approx(1e-3 + 1e-6, rel=1e-6)
    assert "e_score_correction_bias" not in dict(moe.named_parameters())
    assert "gate.e_score_correction_bias" in moe.state_dict()


def rotating_scores(B, S, E, K):
    """Scores where token t strongly prefers experts t*K..t*K+K-1 (mod E): perfectly uniform routing."""
    scores = torch.full((B, S, E), 0.2)
    for t in range(S):
        scores[:, t, [(t * K + j) % E for j in range(K)]] = 0.9
    return scores


def test_sequence_loss_is_alpha_at_uniform_routing():
    E, K = 8, 2
    scores = rotating_scores(3, 16, E, K)  # 16 tokens * 2 slots cover each expert 4 times
    assert sequence_balance_loss(scores, K).item() == pytest.approx(1.0)
    idx = scores.flatten(0, 1).topk(K).indices
    assert batch_balance_loss(scores.flatten(0, 1), idx).item() == pytest.approx(1.0)
    # and through the layer: alpha * 1 at uniform routing, larger when routing collapses
    collapsed = torch.full((3, 16, E), 0.2)
    collapsed[..., :K] = 0.9
    assert sequence_balance_loss(collapsed, K).item() > 2.0


def test_layer_returns_alpha_weighted_losses():
    cfg = replace_moe(tiny_model_cfg(), seq_aux_alpha=1e-4, aux_alpha=1e-2)
    moe = MoE(cfg).train()
    x = torch.randn(2, 12, cfg.dim)
    _, aux = moe(x)
    r = moe.gate(x.view(-1, cfg.dim))
    expected = 1e-4 * sequence_balance_loss(r.scores.view(2, 12, -1), 3) + 1e-2 * batch_balance_loss(
        r.scores, r.topk_idx
    )
    torch.testing.assert_close(aux, expected)
    off = MoE(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, seq_aux_alpha=0.0, aux_alpha=0.0))).train()
    assert off(x)[1].item() == 0.0


# ---- the compiled top-k kernel ----------------------------------------------------------------------------------


def topk_kernel():
    from tests.ops.test_experts import kernel

    return kernel()


def kernel_topk_vs_torch(T, E, G, keep, K, seed=0):
    """The kernel's choice equals the PyTorch code's, in rank order, on untied random scores and biases."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(T, E, generator=gen).sigmoid()
    bias = torch.randn(E, generator=gen) * 0.1
    for b in (bias, None):
        got = topk_kernel().topk_experts(scores, b, K, G, keep)
        assert torch.equal(got, select_experts_torch(scores, b, K, G, keep)), (E, G, keep, K)


@pytest.mark.parametrize("E, G, keep, K", [(8, 1, 1, 2), (16, 4, 2, 3), (64, 8, 4, 8), (64, 8, 8, 6), (12, 6, 1, 2)])
def test_topk_kernel_equals_torch(E, G, keep, K):
    kernel_topk_vs_torch(333, E, G, keep, K)


def test_topk_kernel_breaks_ties_to_the_lower_index():
    """Quantised scores tie everywhere; the reference is a stable sort (value descending, then index)."""
    E, G, keep, K, T = 16, 4, 2, 5, 400
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 4, (T, E), generator=gen).float() / 4
    bias = torch.randint(-1, 2, (E,), generator=gen).float() / 4
    got = topk_kernel().topk_experts(scores, bias, K, G, keep)
    c = (scores + bias).view(T, G, E // G)
    top2 = c.sort(dim=-1, descending=True, stable=True).values[..., :2].sum(-1)
    kept = top2.sort(dim=-1, descending=True, stable=True).indices[:, :keep]
    mask = torch.zeros(T, G, dtype=torch.bool).scatter_(1, kept, True)
    masked = c.masked_fill(~mask[..., None], float("-inf")).view(T, E)
    want = masked.sort(dim=-1, descending=True, stable=True).indices[:, :K]
    assert torch.equal(got, want)
    assert (scores.view(T, -1) == scores[:, :1]).sum() > T  # the input really is full of ties


def test_topk_kernel_ranks_nan_first_like_torch():
    scores = torch.rand(5, 8)
    scores[:, 3] = float("nan")
    got = topk_kernel().topk_experts(scores, None, 2, 1, 1)
    assert (got[:, 0] == 3).all()
    assert torch.equal(got, scores.topk(2, dim=-1).indices)


def test_topk_kernel_rejects_impossible_choices():
    with pytest.raises(RuntimeError, match="k exceeds"):
        topk_kernel().topk_experts(torch.rand(3, 8), None, 5, 4, 2)  # 2 kept groups of 2 experts
    with pytest.raises(RuntimeError, match="n_group must divide"):
        topk_kernel().topk_experts(torch.rand(3, 8), None, 2, 3, 1)
