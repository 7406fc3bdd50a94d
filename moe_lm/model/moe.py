"""The MoE layer: shared experts plus router-weighted routed experts, reached through a dispatcher.

Shape legend: B = batch, S = sequence, D = model dim, T = B*S tokens, E = routed experts, K = experts per token.

The dispatcher is the seam where parallelism enters from outside: single-device code calls the local experts
directly; `moe_lm.parallel` swaps in an expert-parallel dispatcher without touching this file.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from moe_lm.config import ModelConfig
from moe_lm.model.experts import Experts
from moe_lm.model.layers import MLP
from moe_lm.model.router import Router, batch_balance_loss, sequence_balance_loss


class Dispatcher(Protocol):
    """The routed experts' weighted outputs for every token: x [T, D], idx/weight [T, K] -> [T, D]."""

    def __call__(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weight_TK: torch.Tensor, experts) -> torch.Tensor: ...


def local_dispatch(x_TD, idx_TK, weight_TK, experts: Experts) -> torch.Tensor:
    """Every expert lives on this device."""
    return experts(x_TD, idx_TK, weight_TK)


class MoE(nn.Module):
    """DeepSeek-V3 MoE FFN. forward(x [B, S, D]) -> (y [B, S, D], aux_loss scalar)."""

    def __init__(self, model_cfg: ModelConfig) -> None:
        super().__init__()
        cfg = model_cfg.moe
        self.cfg = cfg
        self.gate = Router(model_cfg.dim, cfg, model_cfg.init_std)
        # the routed experts, all of them; under expert parallelism this rank's share (see `parallelize`)
        self.experts: nn.Module = Experts(
            cfg.n_routed_experts, model_cfg.dim, cfg.moe_inter_dim, cfg.experts_impl, model_cfg.init_std
        )
        self.shared_experts = (
            MLP(model_cfg.dim, cfg.n_shared_experts * cfg.moe_inter_dim) if cfg.n_shared_experts > 0 else None
        )
        self.dispatch: Dispatcher = local_dispatch

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        routing = self.gate(x_TD)
        y_TD = self.dispatch(x_TD, routing.topk_idx, routing.topk_weight, self.experts)
        if self.shared_experts is not None:  # every token, weight 1, wherever its routed experts live
            y_TD = y_TD + self.shared_experts(x_TD)
        return y_TD.view(B, S, D), self.balance_loss(routing.scores.view(B, S, -1), routing.topk_idx)

    def parallelize(self, experts: nn.Module, dispatch: Dispatcher) -> None:
        """Expert parallelism's seam (moe_lm/parallel/expert_parallel.py): this rank's share of the routed experts
        (a module called as Experts is) and the dispatcher that reaches the other ranks' experts."""
        self.experts, self.dispatch = experts, dispatch

    def balance_loss(self, scores_BSE: torch.Tensor, idx_TK: torch.Tensor) -> torch.Tensor:
        """Sum of the enabled balance losses (0 when both are off or in eval)."""
        loss = scores_BSE.new_zeros(())
        if not self.training:
            return loss
        if self.cfg.seq_aux_alpha > 0:
            loss = loss + self.cfg.seq_aux_alpha * sequence_balance_loss(scores_BSE, self.cfg.num_experts_per_tok)
        if self.cfg.aux_alpha > 0:
            loss = loss + self.cfg.aux_alpha * batch_balance_loss(scores_BSE.flatten(0, 1), idx_TK)
        return loss
