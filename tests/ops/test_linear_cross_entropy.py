"""The chunked linear cross-entropy against the plain `F.cross_entropy(F.linear(h, W).float(), labels)`: value and
gradients, with unlabelled rows, any chunk size, an upstream gradient, bf16, and no gradients under no_grad."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_lm.ops.linear_cross_entropy import IGNORE, linear_cross_entropy


def inputs(dtype, N=37, D=16, V=53, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=gen) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[::4] = IGNORE
    return h, w, labels


def loss_and_grads(fn, h, w):
    h.grad = w.grad = None
    loss = fn()
    (2.5 * loss).backward()  # an upstream gradient other than 1 (the MTP weight, a loss scale)
    return loss.detach(), h.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("chunk", [1, 5, 36, 37, 1000])
def test_equals_the_plain_cross_entropy_in_value_and_gradients(chunk):
    h, w, labels = inputs(torch.float32)
    ref = loss_and_grads(lambda: F.cross_entropy(F.linear(h, w).float(), labels, ignore_index=IGNORE), h, w)
    got = loss_and_grads(lambda: linear_cross_entropy(h, w, labels, chunk), h, w)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-7)


def test_unlabelled_rows_get_no_gradient_and_bf16_matches_within_rounding():
    h, w, labels = inputs(torch.float32)
    _, gh, _ = loss_and_grads(lambda: linear_cross_entropy(h, w, labels, 8), h, w)
    assert torch.equal(gh[::4], torch.zeros_like(gh[::4])) and gh[1::4].abs().sum() > 0
    hb, wb, _ = inputs(torch.bfloat16)
    ref = loss_and_grads(lambda: F.cross_entropy(F.linear(hb, wb).float(), labels, ignore_index=IGNORE), hb, wb)
    got = loss_and_grads(lambda: linear_cross_entropy(hb, wb, labels, 8), hb, wb)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)  # the same bf16 logits, reduced in fp32
    # the gradients differ by bf16 rounding only (the plain path rounds dW once; here per chunk, summed in fp32)
    torch.testing.assert_close(got[1].float(), ref[1].float(), rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(got[2].float(), ref[2].float(), rtol=2e-2, atol=2e-3)


def test_no_gradients_are_computed_without_autograd_and_chunk_is_checked():
    h, w, labels = inputs(torch.float32)
    with torch.no_grad():
        value = linear_cross_entropy(h, w, labels, 8)
        assert value.grad_fn is None
        assert value.item() == pytest.approx(F.cross_entropy(F.linear(h, w), labels).item(), rel=1e-6)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        linear_cross_entropy(h, w, labels, 0)
