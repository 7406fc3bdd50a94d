"""Masks and attention: causality, the prefix-LM mask, MLA and GQA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_lm.model import Transformer
from moe_lm.model.attention import attention_mask
from tests.tiny import tiny_model_cfg


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
def test_prefix_mask_is_bidirectional_only_inside_the_prefix(attention):
    cfg = dataclasses.replace(tiny_model_cfg(attention), attn_mask="prefix")
    model = Transformer(cfg).eval()
    tokens = torch.randint(0, 97, (1, 20))
    P = 8
    base = model(tokens, prefix_len=P).logits
    # a change at the last prefix position reaches the first position (bidirectional inside the prefix)
    t2 = tokens.clone()
    t2[0, P - 1] = (t2[0, P - 1] + 1) % 97
    assert (model(t2, prefix_len=P).logits[:, 0] - base[:, 0]).abs().max() > 1e-4
    # a change after the prefix stays invisible to everything before it (causal after the prefix)
    t3 = tokens.clone()
    t3[0, 14] = (t3[0, 14] + 1) % 97
    torch.testing.assert_close(model(t3, prefix_len=P).logits[:, :14], base[:, :14], atol=1e-6, rtol=0)
    # prefix_len 0 (or 1) is the causal model
    causal = Transformer(dataclasses.replace(cfg, attn_mask="causal"))
    causal.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(tokens, prefix_len=1).logits, causal.eval()(tokens).logits, atol=1e-5, rtol=1e-5)


def test_prefix_mask_values():
    m = attention_mask("prefix", 5, torch.tensor([3, 0]), torch.device("cpu"))[:, 0]
    expected0 = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(m[0], expected0)
    assert torch.equal(m[1], torch.ones(5, 5).tril().bool())
    with pytest.raises(ValueError, match="prefix_len"):
        attention_mask("prefix", 5, None, torch.device("cpu"))


@pytest.mark.parametrize("attention", ["mla", "gqa"])
@pytest.mark.parametrize("mask", ["causal", "prefix"])
def test_kv_cache_decoding_matches_full_forward(attention, mask):
    from moe_lm.model.attention import KVCache

    cfg = dataclasses.replace(tiny_model_cfg(attention), attn_mask=mask)
    model = Transformer(cfg).eval()
    tokens = torch.randint(0, 97, (2, 16))
    P = 6  # the prompt (the prefix, under the prefix mask) goes in as one chunk, then one token at a time
    full = model(tokens, prefix_len=P).logits
    cache = KVCache()
    steps = [model(tokens[:, :P], prefix_len=P, cache=cache).logits]
    steps += [model(tokens[:, i : i + 1], cache=cache).logits for i in range(P, 16)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 16
