"""The DeepSeek-V3 gate: sigmoid scores, a selection-only bias, group-limited top-k, and the balance terms.

Shape legend: T = tokens, D = model dim, E = routed experts, K = experts per token, G = groups, B = batch,
S = sequence length.

The maths is exactly DeepSeek-V3's inference code and HF `DeepseekV3TopkRouter`, always in fp32:

    s   = sigmoid(x W^T)                 affinity scores                             [T, E]
    sc  = s + b                          used ONLY to choose experts
    group-limited: keep the topk_group groups with the largest sum of their top-2 sc; others -> -inf
    idx = topk(sc, K)                    in rank order (first choice first)          [T, K]
    w   = s[idx] (/ sum if norm_topk_prob) * routed_scaling_factor                   [T, K]
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moe_lm.config import MoEConfig
from moe_lm.model.layers import KeepsFp32Buffers
from moe_lm.ops import expert_counts
from moe_lm.ops.cpu_kernels import cpu_kernels_for


class Routing(NamedTuple):
    """What the router decided for T tokens. Analytics hooks record exactly this."""

    scores: torch.Tensor  # [T, E] fp32 sigmoid affinities, unbiased
    topk_idx: torch.Tensor  # [T, K] int64 chosen experts, first choice first
    topk_weight: torch.Tensor  # [T, K] fp32 gate weights from the unbiased scores


def select_experts(
    scores_TE: torch.Tensor,
    bias_E: torch.Tensor | None,
    k: int,
    n_group: int = 1,
    topk_group: int = 1,
) -> torch.Tensor:
    """Chosen experts [T, K] (rank order) from biased scores, limited to the best `topk_group` groups.

    On CPU the compiled kernel (csrc/route_topk.cpp) makes the same choice in one pass per token; ties, which
    torch.topk leaves unordered, go to the lower index there.
    """
    kernels = cpu_kernels_for(scores_TE, bias_E)
    if kernels is not None:
        return kernels.topk_experts(scores_TE, bias_E, k, n_group, topk_group)
    return select_experts_torch(scores_TE, bias_E, k, n_group, topk_group)


def select_experts_torch(scores_TE, bias_E, k: int, n_group: int = 1, topk_group: int = 1) -> torch.Tensor:
    """`select_experts` in PyTorch ops: any device and dtype, and the reference the kernel is tested against."""
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E
    return limit_to_groups(choice_TE, n_group, topk_group).topk(k, dim=-1).indices


def limit_to_groups(choice_TE: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Choice scores [T, E] with every expert outside the `topk_group` best groups (by the sum of their top-2
    scores) set to -inf."""
    if n_group <= 1:
        return choice_TE
    T, E = choice_TE.shape
    grouped_TGe = choice_TE.view(T, n_group, E // n_group)
    group_score_TG = grouped_TGe.topk(2, dim=-1).values.sum(-1)
    keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
    keep_TG.scatter_(1, group_score_TG.topk(topk_group, dim=-1).indices, True)
    # why -inf and not 0: biased scores can be negative, so a 0 could still beat an eligible expert.
    return grouped_TGe.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, E)


def gate_weights(scores_TE: torch.Tensor, idx_TK: torch.Tensor, norm_topk_prob: bool, scale: float) -> torch.Tensor:
    """Gate weights [T, K] of the chosen experts, from the UNBIASED scores."""
    w_TK = scores_TE.gather(1, idx_TK)
    if norm_topk_prob:
        w_TK = w_TK / (w_TK.sum(-1, keepdim=True) + 1e-20)
    return w_TK * scale


class Router(KeepsFp32Buffers):
    """Sigmoid top-k gate with the auxiliary-loss-free selection bias (named as in HF for interop)."""

    # why: model.to(bfloat16) would round the bias, and updates of 1e-3 vanish in bf16
    fp32_buffers = ("e_score_correction_bias",)

    def __init__(self, dim: int, cfg: MoEConfig, init_std: float = 0.02) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, dim).normal_(0.0, init_std))
        # why a buffer: the bias is not learned by gradient, must never be weight-decayed, and must stay fp32
        # (updates of 1e-3 vanish in bf16); persistent so checkpoints and HF exports carry it.
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        # Token-slots routed to each expert since the last bias update (training forward passes only).
        self.register_buffer(
            "tokens_per_expert", torch.zeros(cfg.n_routed_experts, dtype=torch.int64), persistent=False
        )

    def forward(self, x_TD: torch.Tensor) -> Routing:
        """Route T tokens: x [T, D] -> Routing(scores [T, E], topk_idx [T, K], topk_weight [T, K])."""
        cfg = self.cfg
        scores_TE = F.linear(x_TD.float(), self.weight.float()).sigmoid()
        with torch.no_grad():
            idx_TK = select_experts(
                scores_TE, self.e_score_correction_bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
            )
        weight_TK = gate_weights(scores_TE, idx_TK, cfg.norm_topk_prob, cfg.routed_scaling_factor)
        if self.training and not _in_backward_recompute():
            self.tokens_per_expert += expert_counts(idx_TK, cfg.n_routed_experts)
        return Routing(scores_TE, idx_TK, weight_TK)

    @torch.no_grad()
    def update_bias(self, counts_E: torch.Tensor, speed: float) -> None:
        """Auxiliary-loss-free update b += speed * sign(mean(c) - c) from a step's global integer counts."""
        counts = counts_E.to(self.e_score_correction_bias.device, torch.float64)
        self.e_score_correction_bias += speed * torch.sign(counts.mean() - counts).float()


def update_biases(routers: list[Router], counts: list[torch.Tensor], speed: float) -> None:
    """Apply the loss-free bias update to every router from its step counts (the caller sums them globally)."""
    if len(routers) != len(counts):
        raise ValueError(f"{len(routers)} routers but {len(counts)} count vectors")
    for router, c in zip(routers, counts, strict=True):
        router.update_bias(c, speed)


def sequence_balance_loss(scores_BSE: torch.Tensor, k: int) -> torch.Tensor:
    """DeepSeek-V3 complementary sequence-wise balance loss / alpha (Eq. 17-20), mean over sequences.

    f_i = E/(K S) * #{t : i in topk(s_t, K)} uses the unbiased, not group-limited top-k; P_i is the mean of
    the scores normalised over all experts. Equals 1 at perfectly uniform routing.
    """
    B, S, E = scores_BSE.shape
    with torch.no_grad():
        top_TK = select_experts(scores_BSE.flatten(0, 1), None, k)  # unbiased, not group-limited
        hits_BSE = torch.zeros_like(scores_BSE).scatter_(-1, top_TK.view(B, S, k), 1.0)
        f_BE = hits_BSE.sum(1) * (E / (k * S))
    p_BE = (scores_BSE / (scores_BSE.sum(-1, keepdim=True) + 1e-20)).mean(1)
    return (f_BE * p_BE).sum(-1).mean()


def batch_balance_loss(scores_TE: torch.Tensor, idx_TK: torch.Tensor) -> torch.Tensor:
    """Classic batch-level auxiliary loss / alpha (Switch/GShard form on normalised sigmoid scores).

    f_i = E/(K T) * (token-slots actually routed to i), P_i = mean normalised score; 1 at uniform routing.
    """
    T, E = scores_TE.shape
    K = idx_TK.shape[1]
    with torch.no_grad():
        f_E = expert_counts(idx_TK, E).to(scores_TE.dtype) * (E / (K * T))
    p_E = (scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-20)).mean(0)
    return (f_E * p_E).sum()


def _in_backward_recompute() -> bool:
    # why: activation checkpointing re-runs forward inside backward; those passes must not count tokens again.
    return torch._C._current_graph_task_id() != -1
