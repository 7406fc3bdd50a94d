"""The research variants' attention masks: the prefix-LM mask (bidirectional only inside the prefix, its values,
KV-cache decoding), and the masked-LM encoders' bidirectional and mixed forward/backward masks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_lm.experiments.variants.masks import prefix_mask
from moe_lm.model import Transformer
from moe_lm.testing import tiny_model_cfg
from tests.model.test_attention import kv_cache_decoding_matches_full_forward


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
    m = prefix_mask(5, torch.tensor([3, 0]), torch.device("cpu"))[:, 0]
    expected0 = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(m[0], expected0)
    assert torch.equal(m[1], torch.ones(5, 5).tril().bool())
    with pytest.raises(ValueError, match="prefix_len"):
        prefix_mask(5, None, torch.device("cpu"))


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_kv_cache_decoding_under_the_prefix_mask_matches_full_forward(attention):
    kv_cache_decoding_matches_full_forward(dataclasses.replace(tiny_model_cfg(attention), attn_mask="prefix"))


def test_mixed_attention_masks_by_head_and_by_layer():
    from moe_lm.experiments.attention_probe import attention_matrices, capture_attention

    for kind in ("mixed_heads", "mixed_layers", "bidirectional"):
        model = Transformer(dataclasses.replace(tiny_model_cfg("gqa"), attn_mask=kind)).eval()
        store = []
        with torch.no_grad(), capture_attention(model, store):
            model(torch.randint(0, 97, (1, 12)))
        for layer, (q, k, _, mask, scale, gqa) in enumerate(store):
            A = attention_matrices(q, k, mask, scale, gqa)[0]  # [H, S, S]
            for h in range(A.shape[0]):
                forward = torch.equal(A[h], A[h].tril())
                backward = torch.equal(A[h], A[h].triu())
                if kind == "bidirectional":
                    assert not forward and not backward
                elif kind == "mixed_heads":
                    assert (forward, backward) == ((True, False) if h < 2 else (False, True)), (layer, h)
                else:
                    assert (forward, backward) == ((True, False) if layer % 2 == 0 else (False, True)), (layer, h)
