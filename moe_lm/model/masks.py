"""Attention masks by name (`model.attn_mask`): the extension point through which research variants add masks.

The core model is causal: "causal" builds no mask tensor at all, so attention takes SDPA's is_causal path. A variant
registers a `MaskProvider` under a new name (moe_lm/experiments/variants/masks.py: prefix-LM and the masked-language
models' masks) together with the config rule that goes with it; the model asks the provider for each forward pass's
masks and never needs to know the variant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_lm.config import Config, register_choice

# (S, prefix_len [B] | int | None, device, n_heads, n_layers) -> one mask per layer: bool [B or 1, H or 1, S, S]
# (True = may attend), or None for plain causal attention
LayerMasks = Callable[[int, "torch.Tensor | int | None", torch.device, int, int], "list[torch.Tensor | None]"]


@dataclass(frozen=True)
class MaskProvider:
    layer_masks: LayerMasks
    # forward needs the prefix length (generation passes the prompt's)
    reads_prefix: bool = False
    # incremental decoding works: tokens after a KV cache attend causally to all of it (false for encoders)
    decodes: bool = True


def _causal(S, prefix_len, device, n_heads, n_layers):
    return [None] * n_layers


MASKS: dict[str, MaskProvider] = {"causal": MaskProvider(_causal)}


def register_mask(name: str, provider: MaskProvider, rule: Callable[[Config], None] | None = None) -> None:
    """Make `model.attn_mask=name` build `provider`'s masks; `rule(cfg)` is the config check that goes with it."""
    MASKS[name] = provider
    register_choice("model.attn_mask", name, rule)


def mask_provider(name: str) -> MaskProvider:
    """The provider of a validated `model.attn_mask` (the config refused unknown names)."""
    return MASKS[name]
