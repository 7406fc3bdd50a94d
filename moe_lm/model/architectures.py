"""Architectures by name (`model.arch`): the extension point through which research variants add whole models.

The core has one, "decoder" (the DeepSeek-V3-style decoder-only Transformer). A variant registers an `Architecture`
(moe_lm/experiments/variants/encdec.py: the encoder-decoder) with the config rule that goes with it; building a
model, counting its parameters and FLOPs, and knowing whether it reads a prefix length all go through here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moe_lm.config import Config, ModelConfig, register_choice
from moe_lm.model.masks import mask_provider
from moe_lm.model.params import ParamCount, decoder_decode_flops, decoder_params, decoder_train_flops
from moe_lm.model.transformer import Transformer, build_by_layer


@dataclass(frozen=True)
class Architecture:
    build: Callable[[ModelConfig], nn.Module]
    count_params: Callable[[ModelConfig], ParamCount]
    # (cfg, seq_len, prefix_len) -> training FLOPs per token of a window
    train_flops: Callable[[ModelConfig, int, int], float]
    # (cfg, seq_len, prefix_len) -> forward FLOPs per generated token after a prompt of prefix_len
    decode_flops: Callable[[ModelConfig, int, int], float]
    # forward needs the prefix length (an encoder reads the prefix)
    reads_prefix: bool = False
    # forward can return the last hidden states instead of logits, for the chunked loss (performance.loss_chunk)
    chunked_loss: bool = True


ARCHITECTURES: dict[str, Architecture] = {
    "decoder": Architecture(Transformer, decoder_params, decoder_train_flops, decoder_decode_flops),
}


def register_architecture(name: str, arch: Architecture, rule: Callable[[Config], None] | None = None) -> None:
    """Make `model.arch=name` build `arch`; `rule(cfg)` is the config check that goes with it."""
    ARCHITECTURES[name] = arch
    register_choice("model.arch", name, rule)


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model a ModelConfig describes (the decoder-only Transformer, or a registered architecture)."""
    return ARCHITECTURES[cfg.arch].build(cfg)


def initial_model(cfg: Config) -> nn.Module:
    """The weights a run of this config starts from: the N1 baselines and untrained twins of the analytics and
    experiments, and `moe-lm export --config`. Each part from its own seed with layer seeds (`uses_layer_seeds`),
    else drawn in turn after seeding the global generator, as training does."""
    if uses_layer_seeds(cfg):
        return build_by_layer(cfg.model, cfg.seed)
    torch.manual_seed(cfg.seed)
    return build_model(cfg.model)


def uses_layer_seeds(cfg: Config) -> bool:
    """Whether a run initialises each part of its model from its own seed: train.layer_seeds, always with pipeline
    stages (a stage builds only its own parts)."""
    return cfg.train.layer_seeds or cfg.parallel.pp_size > 1


def loss_chunk(cfg: Config) -> int:
    """performance.loss_chunk where the architecture has the chunked loss, else 0 (the plain loss, which is exact:
    the chunk changes memory and time only)."""
    return cfg.performance.loss_chunk if ARCHITECTURES[cfg.model.arch].chunked_loss else 0


def count_params(cfg: ModelConfig) -> ParamCount:
    return ARCHITECTURES[cfg.arch].count_params(cfg)


def train_flops_per_token(cfg: ModelConfig, seq_len: int, prefix_len: int = 0) -> float:
    """Model FLOPs of training per token of a window (forward + backward, PaLM's accounting)."""
    return ARCHITECTURES[cfg.arch].train_flops(cfg, seq_len, prefix_len)


def decode_flops_per_token(cfg: ModelConfig, seq_len: int, prefix_len: int) -> float:
    """Forward FLOPs per generated token, averaged over positions prefix_len .. seq_len - 1 (prompt not included)."""
    return ARCHITECTURES[cfg.arch].decode_flops(cfg, seq_len, prefix_len)


def reads_prefix(cfg: ModelConfig) -> bool:
    """Whether the model takes the prefix length: a mask bidirectional inside the prefix, or an encoder over it."""
    return mask_provider(cfg.attn_mask).reads_prefix or ARCHITECTURES[cfg.arch].reads_prefix
