"""Attention: causality, and decoding with a KV cache, for MLA and GQA."""

from __future__ import annotations

import pytest
import torch

from moe_lm.model import Transformer
from moe_lm.model.attention import KVCache
from moe_lm.testing import tiny_model_cfg


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


def test_mla_takes_the_fused_attention_kernel_with_the_same_result():
    """MLA's v_head_dim (8) differs from its query/key head dim (8 + 4): V is padded so that SDPA takes its fused
    flash kernel, not the unfused maths, and the output equals attention written out (softmax(q k^T s + causal) v)."""
    from torch.profiler import ProfilerActivity, profile

    from moe_lm.model.attention import MLA, rope_cos_sin

    torch.manual_seed(0)
    cfg = tiny_model_cfg()
    attn = MLA(cfg).eval()
    B, S = 2, 10
    x = torch.randn(B, S, cfg.dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, attn.rope, 2).float() / attn.rope))
    cos, sin = rope_cos_sin(inv_freq, torch.arange(S), torch.float32)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        out = attn(x, cos, sin, None)
    names = {e.key for e in prof.key_averages()}
    assert any("flash_attention" in n for n in names), sorted(n for n in names if "attention" in n)
    captured = {}

    def keep_inputs(module, args, output):  # the kernel's inputs, through the public hook the attention probe uses
        q, k, v = args[:3]
        captured.update(q=q[..., : attn.nope + attn.rope], k=k[..., : attn.nope + attn.rope], v=v[..., : attn.v_dim])

    hook = attn.sdpa.register_forward_hook(keep_inputs)
    with torch.no_grad():
        attn(x, cos, sin, None)
    hook.remove()
    q, k, v = captured["q"], captured["k"], captured["v"]
    scores = q @ k.transpose(-1, -2) * attn.scale + torch.full((S, S), float("-inf")).triu(1)
    written_out = scores.softmax(-1) @ v
    expected = attn.o_proj(written_out.transpose(1, 2).reshape(B, S, -1))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_mla_attention_kernel_is_chosen_from_what_each_takes_and_no_query_column_is_copied():
    """On the CPU only FlashAttention is fused, and it needs one head dim: v padded to the query's width, which
    equal head dims never need. The rotary query columns are rotated in the projection's own output: no
    concatenation of rope and nope parts (it copied every query column of every layer)."""
    from torch.nn.attention import SDPBackend
    from torch.utils._python_dispatch import TorchDispatchMode

    from moe_lm.model import sdpa_backend
    from moe_lm.model.attention import MLA, rope_cos_sin
    from moe_lm.model.sdpa_backend import Choice, mla_choice

    assert mla_choice("cpu", torch.float32, 192, 128) == Choice(SDPBackend.FLASH_ATTENTION, True)
    assert mla_choice("cpu", torch.float32, 128, 128) == Choice(SDPBackend.FLASH_ATTENTION, False)
    assert mla_choice("cpu", torch.float32, 128, 192) == Choice(SDPBackend.MATH, False)  # v wider: no fused kernel
    assert mla_choice("cpu", torch.float32, 192, 128).describe(192, 128) == (
        "FlashAttention (q/k heads 192, v padded from 128 to 192)"
    )
    # the choice is kept for the process: one first asked under no_grad or inference_mode (a generation or an
    # evaluation before training) is the same (its trial's backward once failed there: the math kernel was kept)
    for mode in (torch.no_grad, torch.inference_mode):
        sdpa_backend._CHOSEN.clear()
        with mode():
            assert mla_choice("cpu", torch.float32, 192, 128) == Choice(SDPBackend.FLASH_ATTENTION, True), mode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    cfg = tiny_model_cfg()
    attn = MLA(cfg)
    S = 10
    x = torch.randn(2, S, cfg.dim, requires_grad=True)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, attn.rope, 2).float() / attn.rope))
    cos, sin = rope_cos_sin(inv_freq, torch.arange(S), torch.float32)
    with Ops() as ops:
        out = attn(x, cos, sin, None)
    assert ops.names.count("cat") == 2  # apply_rope's rotate-half, of the query's and the key's rotary columns only
    assert ops.names.count("constant_pad_nd") == 1  # v, for the fused kernel
    out.sum().backward()  # the in-place rotation keeps autograd's graph whole
    assert torch.isfinite(x.grad).all() and all(p.grad is not None for p in attn.parameters())
