"""Objectives of the research variants, registered as `objective.name` values (moe_lm/train/objective.py); owned by
the experiments that use them (`mask`, `encdec`: prefix_lm; `mlm-mix`: mlm; docs/experiments.md §5).

- "prefix_lm" with prefix_len P: t_0 .. t_{P-1} are input only; the labels are t_P .. t_S (positions j >= P - 1).
  With model.attn_mask=prefix the model attends bidirectionally inside the prefix (UniLM / prefix LM); with a
  causal mask it is the same labels under causal attention (a GPT scored on the same targets); an encoder-decoder
  (model.arch=encdec) encodes the prefix and decodes the rest.
- "mlm": masked-language modelling on t_0 .. t_{S-1}: each position is chosen with probability mlm_prob; a chosen
  token becomes MASK_ID (80 %), a random token (10 %) or stays (10 %), and is predicted at its own position (BERT's
  recipe). The choices are drawn from a generator seeded by the window's tokens and the run's seed, so every arm
  of an experiment, every resume and every evaluation sees the same masks for the same window. No label lies
  inside the prefix, so bidirectional attention never sees a token it is asked to predict.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from moe_lm.config import Config, ConfigError
from moe_lm.experiments.variants.masks import MLM_MASKS
from moe_lm.model import ModelOutput, loss_chunk, reads_prefix
from moe_lm.train.objective import IGNORE, register_objective

# why 0: sentencepiece's <unk>, which a byte-fallback tokenizer never emits, so it can stand for [MASK] without
# preparing the data again
MASK_ID = 0


@dataclass(frozen=True)
class PrefixLM:
    """Labels after the first `prefix_len` tokens only; the model is told the prefix length if it reads it (a
    bidirectional prefix mask, or an encoder over the prefix)."""

    prefix_len: int
    model_reads_prefix: bool = False
    loss_chunk: int = 0

    @classmethod
    def of(cls, cfg: Config) -> PrefixLM:
        return cls(cfg.objective.prefix_len, reads_prefix(cfg.model), loss_chunk(cfg))

    def run(
        self, model, window_BS1: torch.Tensor, mtp: bool = False, logits: bool = True
    ) -> tuple[ModelOutput, torch.Tensor]:
        prefix = self.prefix_len if self.model_reads_prefix else None
        return model(window_BS1[:, :-1], prefix_len=prefix, mtp=mtp, logits=logits), self.labels(window_BS1)

    def labels(self, window_BS1: torch.Tensor) -> torch.Tensor:
        labels = window_BS1[:, 1:].clone()
        labels[:, : self.prefix_len - 1] = IGNORE
        return labels


@dataclass(frozen=True)
class MLM:
    """Masked-language modelling: content-seeded 80/10/10 corruption, each chosen token predicted in place."""

    mlm_prob: float = 0.15
    vocab_size: int = 0  # where random replacements are drawn from
    seed: int = 0
    loss_chunk: int = 0

    @classmethod
    def of(cls, cfg: Config) -> MLM:
        return cls(cfg.objective.mlm_prob, cfg.model.vocab_size, cfg.seed, loss_chunk(cfg))

    def run(
        self, model, window_BS1: torch.Tensor, mtp: bool = False, logits: bool = True
    ) -> tuple[ModelOutput, torch.Tensor]:
        inputs, labels = self.corrupt(window_BS1[:, :-1])
        return model(inputs, logits=logits), labels

    def corrupt(self, tokens_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(corrupted inputs [B, S], labels [B, S]: the original token where chosen, IGNORE elsewhere)."""
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


def _prefix_lm_rule(cfg: Config) -> None:
    P, S = cfg.objective.prefix_len, cfg.train.seq_len
    if not 0 < P < S:
        raise ConfigError(
            f"objective.prefix_len must be between 1 and train.seq_len - 1 = {S - 1} for objective.name=prefix_lm, "
            f"got {P}"
        )


def _mlm_rule(cfg: Config) -> None:
    if cfg.model.attn_mask not in MLM_MASKS:
        raise ConfigError(
            f"objective.name = mlm predicts tokens in place: use model.attn_mask={', '.join(MLM_MASKS[:-1])} or "
            f"{MLM_MASKS[-1]}"
        )


def register() -> None:
    register_objective("prefix_lm", PrefixLM.of, _prefix_lm_rule)
    register_objective("mlm", MLM.of, _mlm_rule)
