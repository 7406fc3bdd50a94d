"""The training objective: next-token cross-entropy of the main head, plus the MTP depths' (DeepSeek-V3 §2.2).

    loss = CE_main + (lambda / D) * sum_k CE_k + balance losses

Each CE is the mean over the positions that have a target: all S for the main head, S - k at depth k (position i
of depth k predicts token i + k + 1 of the window). The paper divides each sum by the sequence length instead;
for S >> D the two differ by a factor (S - k) / S.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_lm.model import ModelOutput


def next_token_losses(out: ModelOutput, targets_BS: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(main head's mean CE, [mean CE of MTP depth k for k = 1..D]) against targets [B, S] (the window shifted by
    one)."""
    ce = F.cross_entropy(out.logits.float().flatten(0, 1), targets_BS.flatten())
    mtp = [
        F.cross_entropy(logits.float().flatten(0, 1), targets_BS[:, k:].flatten())
        for k, logits in enumerate(out.mtp_logits, start=1)
    ]
    return ce, mtp


def total_loss(ce: torch.Tensor, mtp: list[torch.Tensor], mtp_weight: float, aux_loss: torch.Tensor) -> torch.Tensor:
    """What backward runs on: CE_main + (lambda / D) sum_k CE_k + the balance losses."""
    loss = ce + aux_loss
    if mtp:
        loss = loss + (mtp_weight / len(mtp)) * torch.stack(mtp).sum()
    return loss
