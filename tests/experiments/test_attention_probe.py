"""The attention-rank probe on known answers, and its matrices against the model's own attention output."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moe_lm.experiments.variants  # noqa: F401  (registers the research variants used below)
from moe_lm.experiments.attention_probe import (
    attention_matrices,
    capture_attention,
    erank_by_layer,
    rank_metrics,
    relative_residual,
    synthetic_erank,
)
from moe_lm.model import Transformer
from moe_lm.testing import tiny_model_cfg


def test_a_causal_softmax_matrix_is_exactly_full_rank_in_float64():
    """Lower-triangular with a positive diagonal: det = prod(diagonal) > 0, exactly full rank; numerically (SVD at
    n * eps) it is full rank at n = 32 but not always at n = 128: triangular matrices grow ill-conditioned."""
    gen = torch.Generator().manual_seed(0)
    for n in (32, 128):
        q = torch.randn(2, 3, n, 16, generator=gen, dtype=torch.float64)
        k = torch.randn(2, 3, n, 16, generator=gen, dtype=torch.float64)
        A = attention_matrices(q, k, None, 16**-0.5)
        assert torch.equal(A, A.tril()) and torch.allclose(A.sum(-1), torch.ones(2, 3, n, dtype=torch.float64))
        m = rank_metrics(A)
        assert (m["nonzero_diagonal"] == n).all()  # exactly nonsingular
        assert torch.equal(torch.linalg.det(A[0, 0]).sign(), torch.tensor(1.0, dtype=torch.float64))
        assert (m["s_min"] <= m["min_diagonal"] * (1 + 1e-9)).all()  # s_min <= min |diagonal| for triangular
        if n == 32:
            assert (m["rank_eps"] == n).all()
    assert (m["rank_eps"] < 128).any() and (m["rank_1e-06"] <= m["rank_eps"]).all()


def test_equal_logits_bidirectional_is_rank_one_and_a_sharp_diagonal_is_full():
    n = 64
    q = torch.zeros(1, 1, n, 8, dtype=torch.float64)
    full = torch.ones(n, n, dtype=torch.bool)
    m = rank_metrics(attention_matrices(q, q, full, 1.0))  # every logit 0: A = 1/n everywhere
    assert m["rank_eps"].item() == 1 and abs(m["erank"].item() - 1) < 1e-6 and abs(m["stable_rank"].item() - 1) < 1e-9
    eye = torch.eye(n, dtype=torch.float64)[None, None] * 50.0  # q.k large on the diagonal only
    m = rank_metrics(attention_matrices(eye, torch.eye(n, dtype=torch.float64)[None, None], full, 1.0))
    assert m["rank_eps"].item() == n and m["erank"].item() > 0.99 * n


def test_relative_residual_known_answers():
    same = torch.ones(2, 10, 4) * torch.tensor([1.0, -2.0, 3.0, 0.5])
    assert torch.allclose(relative_residual(same), torch.zeros(2, dtype=torch.float64))
    centred = torch.randn(3, 50, 8)
    centred -= centred.mean(1, keepdim=True)
    assert torch.allclose(relative_residual(centred), torch.ones(3, dtype=torch.float64))


def test_probe_matrices_reproduce_the_models_attention_output():
    """A recomputed from the captured q, k, mask and scale, times v, is what the attention kernel returned: for
    MLA and GQA (its kv heads expanded), causal and with a bidirectional prefix."""
    for attention_kind, mask in (("mla", "causal"), ("gqa", "causal"), ("gqa", "prefix"), ("mla", "prefix")):
        cfg = dataclasses.replace(tiny_model_cfg(attention_kind), attn_mask=mask)
        model = Transformer(cfg).eval()
        store = []
        with torch.no_grad(), capture_attention(model, store):
            model(torch.randint(0, 97, (2, 20)), prefix_len=8 if mask == "prefix" else None)
        assert len(store) == cfg.n_layers
        for q, k, v, m, scale, gqa in store:
            A = attention_matrices(q, k, m, scale, gqa)
            if gqa and v.shape[1] != q.shape[1]:
                v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            want = torch.nn.functional.scaled_dot_product_attention(
                q, k if not gqa else k.repeat_interleave(q.shape[1] // k.shape[1], dim=1), v, attn_mask=m,
                is_causal=m is None, scale=scale,
            )  # fmt: skip
            torch.testing.assert_close((A @ v.double()).float(), want, atol=1e-5, rtol=1e-4)
            if mask == "prefix":  # rows inside the prefix attend to all of it; later rows causally
                assert (A[..., :8, 7] > 0).all() and (A[..., 8, 9:] == 0).all() and (A[..., :8, 8:] == 0).all()


def test_synthetic_control_bidirectional_erank_falls_with_logit_scale():
    er = synthetic_erank(n=64, d=8, scales=[0.0, 8.0], trials=2)
    assert abs(er["bidirectional"][0] - 1.0) < 1e-6  # scale 0: uniform, rank one
    assert er["bidirectional"][1] > 5 and er["causal"][0] > 5  # sharp logits raise it; causal averaging is high rank


def _erank(A: torch.Tensor) -> float:
    """Roy & Vetterli's effective rank, written out: exp of the entropy of the normalised singular values."""
    s = torch.linalg.svdvals(A.double())
    p = s / s.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def test_erank_by_layer_on_equal_logits_known_answers():
    """With the query projections zeroed every logit is 0, so each attention row is uniform over what it may see:
    bidirectional layers give the all-1/n matrix (effective rank 1); forward and backward layers (the mixed masks)
    give the averaging matrix L with L[i, j] = 1/(i+1), j <= i, or its transpose, whose effective rank the test
    computes from L itself. Also: a layer's value is the mean over heads and windows (batching does not matter)."""
    n = 24
    lower = torch.tril(torch.ones(n, n, dtype=torch.float64)) / torch.arange(1, n + 1, dtype=torch.float64)[:, None]
    averaging = _erank(lower)
    assert abs(averaging - _erank(lower.T)) < 1e-9 and averaging > 3
    windows = torch.randint(1, 97, (5, n), generator=torch.Generator().manual_seed(0))
    for mask, want in (("bidirectional", [1.0] * 3), ("mixed_layers", [averaging] * 3),
                       ("mixed_heads", [averaging] * 3)):  # fmt: skip
        model = Transformer(dataclasses.replace(tiny_model_cfg("gqa"), attn_mask=mask)).eval()
        with torch.no_grad():
            for layer in model.layers:
                layer.self_attn.q_proj.weight.zero_()
        got = erank_by_layer(model, windows, batch=2)
        assert got == pytest.approx(want, rel=1e-6), mask
    # a trained-like (random) model: the per-layer value is the mean of each window's and head's effective rank
    model = Transformer(dataclasses.replace(tiny_model_cfg("gqa"), attn_mask="mixed_heads")).eval()
    store = []
    with torch.no_grad(), capture_attention(model, store):
        model(windows)
    want = [
        sum(_erank(A) for A in attention_matrices(q, k, m, scale, gqa).flatten(0, 1)) / (5 * 4)
        for q, k, _, m, scale, gqa in store
    ]
    assert erank_by_layer(model, windows, batch=3) == pytest.approx(want, rel=1e-9)
