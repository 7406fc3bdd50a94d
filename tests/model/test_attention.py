"""Attention: causality, and decoding with a KV cache, for MLA and GQA."""

from __future__ import annotations

import pytest
import torch

from moe_lm.model import Transformer
from moe_lm.model.attention import KVCache
from tests.helpers.tiny import tiny_model_cfg


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_future_tokens_never_change_past_logits(attention):
    model = Transformer(tiny_model_cfg(attention)).eval()
    tokens = torch.randint(0, 97, (2, 20))
    changed = tokens.clone()
    changed[:, 12:] = torch.randint(0, 97, (2, 8))
    a, b = model(tokens).logits, model(changed).logits
    torch.testing.assert_close(a[:, :12], b[:, :12], atol=1e-6, rtol=0)
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-4  # the change is visible where it may be


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_kv_cache_decoding_matches_full_forward(attention):
    kv_cache_decoding_matches_full_forward(tiny_model_cfg(attention))


def kv_cache_decoding_matches_full_forward(cfg) -> None:
    """Decoding a prompt and then one token at a time with a KVCache gives the full forward's logits."""
    model = Transformer(cfg).eval()
    tokens = torch.randint(0, 97, (2, 16))
    P = 6  # the prompt (the prefix, under the prefix mask) goes in as one chunk, then one token at a time
    full = model(tokens, prefix_len=P).logits
    cache = KVCache()
    steps = [model(tokens[:, :P], prefix_len=P, cache=cache).logits]
    steps += [model(tokens[:, i : i + 1], cache=cache).logits for i in range(P, 16)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 16
