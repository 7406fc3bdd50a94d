"""The training objective: which tokens of a window are predicted, how the model sees the rest, and the losses.

A window holds tokens t_0 .. t_S; the model reads t_0 .. t_{S-1} and position j predicts t_{j+1}.
- "lm": every t_1 .. t_S is a label.
- "prefix_lm" with prefix_len P: t_0 .. t_{P-1} are input only; the labels are t_P .. t_S (positions j >= P - 1).
  With model.attn_mask=prefix the model attends bidirectionally inside the prefix (UniLM / prefix LM); with a
  causal mask it is the same labels under causal attention (a GPT scored on the same targets); an encoder-decoder
  (model.arch=encdec) encodes the prefix and decodes the rest.
- "mlm": masked-language modelling on t_0 .. t_{S-1}: each position is chosen with probability mlm_prob; a chosen
  token becomes MASK_ID (80 %), a random token (10 %) or stays (10 %), and is predicted at its own position (BERT's
  recipe). The choices are drawn from a generator seeded by the window's tokens and the run's seed, so every arm
  of an experiment, every resume and every evaluation sees the same masks for the same window. No label lies
  inside the prefix, so bidirectional attention never sees a token it is asked to predict.

    loss = CE_main + (lambda / D) * sum_k CE_k + balance losses           (MTP, DeepSeek-V3 §2.2)

Each CE is the mean over the labelled positions: for MTP depth k, position i predicts t_{i+k+1}, labelled iff the
main head's label at position i + k is (the paper divides each sum by the sequence length instead; for S >> D the
two differ by a factor (S - k) / S).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_lm.config import Config
from moe_lm.model import ModelOutput
from moe_lm.ops.linear_cross_entropy import IGNORE, linear_cross_entropy  # IGNORE: a position with no label

# why 0: sentencepiece's <unk>, which a byte-fallback tokenizer never emits, so it can stand for [MASK] without
# preparing the data again
MASK_ID = 0


@dataclass(frozen=True)
class Objective:
    kind: str = "lm"  # "lm" | "prefix_lm"
    prefix_len: int = 0
    # the model is told the prefix length: it attends bidirectionally inside the prefix (attn_mask=prefix), or its
    # encoder reads the prefix (arch=encdec)
    model_reads_prefix: bool = False
    mlm_prob: float = 0.15
    vocab_size: int = 0  # mlm: where random replacements are drawn from
    seed: int = 0
    loss_chunk: int = 0  # training: the head's loss this many tokens at a time (0: from full logits)

    @classmethod
    def of(cls, cfg: Config) -> Objective:
        t = cfg.train
        prefix = t.prefix_len if t.objective == "prefix_lm" else 0
        return cls(
            t.objective, prefix, reads_prefix(cfg.model), t.mlm_prob, cfg.model.vocab_size, cfg.seed, t.loss_chunk
        )

    def run(
        self, model, window_BS1: torch.Tensor, mtp: bool = False, logits: bool = True
    ) -> tuple[ModelOutput, torch.Tensor]:
        """The model's output on a batch of windows [B, S + 1] and the labels [B, S] (IGNORE where unlabelled).
        logits=False: the output heads are skipped (for next_token_losses with a chunk)."""
        if self.kind == "mlm":
            inputs, labels = self.corrupt(window_BS1[:, :-1])
            return model(inputs, logits=logits), labels
        prefix = self.prefix_len if self.model_reads_prefix else None
        return model(window_BS1[:, :-1], prefix_len=prefix, mtp=mtp, logits=logits), self.labels(window_BS1)

    def corrupt(self, tokens_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """mlm: (corrupted inputs [B, S], labels [B, S]: the original token where chosen, IGNORE elsewhere)."""
        inputs, labels = tokens_BS.clone(), torch.full_like(tokens_BS, IGNORE)
        for b, row in enumerate(tokens_BS.cpu()):
            gen = torch.Generator().manual_seed(zlib.crc32(row.numpy().tobytes()) ^ (self.seed * 2654435761 % 2**32))
            u, kind = torch.rand(len(row), generator=gen), torch.rand(len(row), generator=gen)
            random_tokens = torch.randint(0, self.vocab_size, (len(row),), generator=gen)
            dev = tokens_BS.device
            chosen, kind, random_tokens = (u < self.mlm_prob).to(dev), kind.to(dev), random_tokens.to(dev)
            labels[b, chosen] = tokens_BS[b, chosen]
            inputs[b, chosen & (kind < 0.8)] = MASK_ID
            swap = chosen & (kind >= 0.8) & (kind < 0.9)
            inputs[b, swap] = random_tokens[swap]
        return inputs, labels

    def labels(self, window_BS1: torch.Tensor) -> torch.Tensor:
        labels = window_BS1[:, 1:].clone()
        if self.kind == "prefix_lm":
            labels[:, : self.prefix_len - 1] = IGNORE
        return labels


def reads_prefix(model_cfg) -> bool:
    """Whether the model takes the prefix length: a bidirectional prefix mask, or an encoder over the prefix."""
    return model_cfg.attn_mask == "prefix" or model_cfg.arch == "encdec"


NEXT_TOKEN = Objective()  # plain language modelling: every next token is a label


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


def loss_sums(out: ModelOutput, labels_BS: torch.Tensor) -> tuple[float, int, list[tuple[float, int]]]:
    """For evaluation: (summed main-head NLL, labelled positions, [(summed NLL, positions) per MTP depth])."""

    def summed(logits, labels):
        nll = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        return nll.item(), int((labels != IGNORE).sum())

    main = summed(out.logits, labels_BS)
    return *main, [summed(logits, labels_BS[:, k:]) for k, logits in enumerate(out.mtp_logits, start=1)]
