"""Attention masks of the research variants, registered as `model.attn_mask` names (moe_lm/model/masks.py); owned by
the experiments that use them (`mask` and `rank`: prefix; `mlm-mix`: the encoders' masks; docs/experiments.md §5).

- "prefix": bidirectional inside each sequence's prefix, causal after it (prefix LM / UniLM); trained with
  objective.name=prefix_lm, which supplies the prefix length.
- For masked-language-model encoders (objective.name=mlm): "bidirectional" (every position sees every other);
  "mixed_heads" (the first half of the heads forward, j <= i, the other half backward, j >= i: with GQA each kv head
  serves one direction when the halves align with its query groups); "mixed_layers" (forward in even layers,
  backward in odd ones) -- Su Jianlin's mixed forward/backward attention (kexue.fm/archives/9529).

Masks are boolean, True = may attend.
"""

from __future__ import annotations

import torch

from moe_lm.config import Config, ConfigError
from moe_lm.model.masks import MaskProvider, register_mask

MLM_MASKS = ("bidirectional", "mixed_heads", "mixed_layers")


def prefix_mask(S: int, prefix_len: torch.Tensor | int | None, device: torch.device) -> torch.Tensor:
    """[B, 1, S, S]: token i sees token j if j <= i or both lie inside the sequence's prefix (j < prefix_len[b])."""
    if prefix_len is None:
        raise ValueError("attn_mask='prefix' needs prefix_len (one length per sequence, [B] or an int)")
    pos = torch.arange(S, device=device)
    causal_SS = pos[None, :] <= pos[:, None]
    prefix_BS = pos[None, :] < torch.as_tensor(prefix_len, device=device).reshape(-1, 1)
    return (causal_SS[None] | prefix_BS[:, None, :])[:, None]


def _prefix(S, prefix_len, device, n_heads, n_layers):
    return [prefix_mask(S, prefix_len, device)] * n_layers


def _bidirectional(S, prefix_len, device, n_heads, n_layers):
    return [torch.ones(1, 1, S, S, dtype=torch.bool, device=device)] * n_layers


def _forward(S: int, device) -> torch.Tensor:
    pos = torch.arange(S, device=device)
    return pos[None, :] <= pos[:, None]  # [S, S]


def _mixed_heads(S, prefix_len, device, n_heads, n_layers):
    forward, half = _forward(S, device), n_heads // 2
    return [torch.stack([forward] * half + [forward.T] * (n_heads - half))[None]] * n_layers


def _mixed_layers(S, prefix_len, device, n_heads, n_layers):
    forward = _forward(S, device)
    return [(forward if i % 2 == 0 else forward.T)[None, None] for i in range(n_layers)]


def _no_mtp(cfg: Config) -> None:
    # why: inside a bidirectional span, MTP module k at position i would see the embedding of token i + k, a target
    if cfg.model.mtp.depth:
        raise ConfigError(
            "model.mtp.depth > 0 needs model.attn_mask=causal (an MTP module would see targets through a "
            f"bidirectional {'prefix' if cfg.model.attn_mask == 'prefix' else 'mask'})"
        )


def _prefix_rule(cfg: Config) -> None:
    _no_mtp(cfg)
    if cfg.objective.name != "prefix_lm":
        raise ConfigError(
            "model.attn_mask = prefix needs objective.name=prefix_lm with an objective.prefix_len (the plain LM "
            "objective supplies no prefix to attend to bidirectionally)"
        )


def _mlm_mask_rule(cfg: Config) -> None:
    _no_mtp(cfg)
    if cfg.objective.name != "mlm":
        raise ConfigError(
            f"model.attn_mask = {cfg.model.attn_mask} sees the next token: it needs objective.name=mlm (a "
            "masked-language-model encoder)"
        )


def register() -> None:
    register_mask("prefix", MaskProvider(_prefix, reads_prefix=True, decodes=True), _prefix_rule)
    for name, build in zip(MLM_MASKS, (_bidirectional, _mixed_heads, _mixed_layers), strict=True):
        register_mask(name, MaskProvider(build, decodes=False), _mlm_mask_rule)
