"""The training objective: which tokens of a window are predicted, how the model sees the rest, and the losses.

A window holds tokens t_0 .. t_S; the model reads t_0 .. t_{S-1} and position j predicts t_{j+1}. The core
objective, "lm", labels every t_1 .. t_S. Objectives are found by name (`objective.name`) in a registry: research
variants add theirs (moe_lm/experiments/variants/objectives.py: prefix LM, masked LM) through `register_objective`,
and the training loop and evaluation only ever call `objective.run`.

    loss = CE_main + (lambda / D) * sum_k CE_k + balance losses           (MTP, DeepSeek-V3 §2.2)

Each CE is the mean over the labelled positions: for MTP depth k, position i predicts t_{i+k+1}, labelled iff the
main head's label at position i + k is (the paper divides each sum by the sequence length instead; for S >> D the
two differ by a factor (S - k) / S).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from moe_lm.config import Config, register_choice
from moe_lm.model import ModelOutput, loss_chunk
from moe_lm.ops.linear_cross_entropy import IGNORE, linear_cross_entropy  # IGNORE: a position with no label


class Objective(Protocol):
    # training: the head's loss this many tokens at a time (0: from full logits)
    loss_chunk: int

    def run(
        self, model, window_BS1: torch.Tensor, mtp: bool = False, logits: bool = True
    ) -> tuple[ModelOutput, torch.Tensor]:
        """The model's output on a batch of windows [B, S + 1] and the labels [B, S] (IGNORE where unlabelled).
        logits=False: the output heads are skipped (for next_token_losses with a chunk)."""
        ...


@dataclass(frozen=True)
class NextToken:
    """Plain language modelling: every next token is a label."""

    loss_chunk: int = 0

    def run(
        self, model, window_BS1: torch.Tensor, mtp: bool = False, logits: bool = True
    ) -> tuple[ModelOutput, torch.Tensor]:
        return model(window_BS1[:, :-1], mtp=mtp, logits=logits), self.labels(window_BS1)

    def labels(self, window_BS1: torch.Tensor) -> torch.Tensor:
        return window_BS1[:, 1:].clone()


NEXT_TOKEN = NextToken()

OBJECTIVES: dict[str, Callable[[Config], Objective]] = {"lm": lambda cfg: NextToken(loss_chunk(cfg))}


def register_objective(
    name: str, factory: Callable[[Config], Objective], rule: Callable[[Config], None] | None = None
) -> None:
    """Make `objective.name=name` train with `factory(cfg)`; `rule(cfg)` is the config check that goes with it."""
    OBJECTIVES[name] = factory
    register_choice("objective.name", name, rule)


def objective_for(cfg: Config) -> Objective:
    """The objective a validated config trains (the config refused unknown names)."""
    return OBJECTIVES[cfg.objective.name](cfg)


def next_token_losses(
    out: ModelOutput, labels_BS: torch.Tensor, head: torch.Tensor | None = None, chunk: int = 0
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(main head's mean CE, [mean CE of MTP depth k for k = 1..D]) over the labelled positions. Without logits
    (forward(..., logits=False)) from the heads' inputs and the head weight `head`, `chunk` tokens at a time."""
    if out.logits is None:
        ce = linear_cross_entropy(out.hidden.flatten(0, 1), head, labels_BS.flatten(), chunk)
        mtp = [
            linear_cross_entropy(h.flatten(0, 1), head, labels_BS[:, k:].flatten(), chunk)
            for k, h in enumerate(out.mtp_hidden, start=1)
        ]
        return ce, mtp
    ce = F.cross_entropy(out.logits.float().flatten(0, 1), labels_BS.flatten(), ignore_index=IGNORE)
    mtp = [
        F.cross_entropy(logits.float().flatten(0, 1), labels_BS[:, k:].flatten(), ignore_index=IGNORE)
        for k, logits in enumerate(out.mtp_logits, start=1)
    ]
    return ce, mtp


def total_loss(ce: torch.Tensor, mtp: list[torch.Tensor], mtp_weight: float, aux_loss: torch.Tensor) -> torch.Tensor:
    """What backward runs on: CE_main + (lambda / D) sum_k CE_k + the balance losses."""
    loss = ce + aux_loss
    if mtp:
        loss = loss + (mtp_weight / len(mtp)) * torch.stack(mtp).sum()
    return loss


def logged_losses(ce: torch.Tensor, mtp: list[torch.Tensor], aux_loss: torch.Tensor) -> torch.Tensor:
    """One micro-batch's row of the step's sums: [CE_main, balance losses, CE_k for k = 1..D, 1 (the count)]."""
    return torch.stack([ce.detach(), aux_loss.detach().float(), *(m.detach() for m in mtp), ce.new_ones(())])


def loss_sums(out: ModelOutput, labels_BS: torch.Tensor) -> tuple[float, int, list[tuple[float, int]]]:
    """For evaluation: (summed main-head NLL, labelled positions, [(summed NLL, positions) per MTP depth])."""

    def summed(logits, labels):
        nll = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        return nll.item(), int((labels != IGNORE).sum())

    main = summed(out.logits, labels_BS)
    return *main, [summed(logits, labels_BS[:, k:]) for k, logits in enumerate(out.mtp_logits, start=1)]
