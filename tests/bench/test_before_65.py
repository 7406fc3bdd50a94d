"""The paths as they were before issue 65 (moe_lm/bench/before_65.py), kept for the speed comparison: each computes
what today's computes, so that the benchmark times the same step two ways."""

from __future__ import annotations

import pytest
import torch

from moe_lm.bench.before_65 import concatenating_forward, scatter_add_mm, switch_back
from moe_lm.model import Transformer
from moe_lm.model.attention import MLA, rope_cos_sin
from moe_lm.ops.grouped import grouped_mm
from moe_lm.testing import tiny_model_cfg


def test_the_scatter_add_path_computes_what_the_gather_path_does():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not in this torch build")
    E, D, I, M, K = 4, 16, 8, 24, 2
    x = torch.randn(M, D, requires_grad=True)
    w = torch.rand(M, K, requires_grad=True)
    gu, dn = torch.randn(E, 2 * I, D, requires_grad=True), torch.randn(E, D, I, requires_grad=True)
    expert = torch.stack([torch.randperm(E)[:K] for _ in range(M)])
    grad = torch.randn(M, D)
    outs = []
    for fn in (scatter_add_mm, grouped_mm):
        for t in (x, w, gu, dn):
            t.grad = None
        y = fn(x, expert, w, gu, dn)
        y.backward(grad)
        outs.append([y.detach(), x.grad, w.grad, gu.grad, dn.grad])
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_the_concatenating_attention_computes_what_todays_does():
    cfg = tiny_model_cfg()
    attn = MLA(cfg).eval()
    S = 10
    x = torch.randn(2, S, cfg.dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, attn.rope, 2).float() / attn.rope))
    cos, sin = rope_cos_sin(inv_freq, torch.arange(S), torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(concatenating_forward(attn, x, cos, sin, None), attn(x, cos, sin, None))


def test_a_model_switched_back_gives_the_same_logits():
    model = Transformer(tiny_model_cfg()).eval()
    tokens = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        today = model(tokens).logits
        before = switch_back(model, ("dispatch", "attention"))(tokens).logits
    torch.testing.assert_close(before, today, atol=1e-5, rtol=1e-5)
    assert all(m.forward.__func__ is concatenating_forward for m in model.modules() if isinstance(m, MLA))
    with pytest.raises(ValueError, match="no such change"):
        switch_back(model, ("loss",))
