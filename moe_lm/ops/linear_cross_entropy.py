"""Cross-entropy of a linear output head, computed a chunk of tokens at a time: the [tokens, vocab] logits never
exist whole.

    loss = mean over labelled rows n of ( logsumexp_v (h_n . W_v) - h_n . W_{label_n} )

The plain path (`F.cross_entropy(lm_head(h).float(), labels)`) keeps the logits (bf16 under mixed precision), their
fp32 copy and the fp32 log-softmax for backward, and backward adds fp32 and bf16 gradients of the same size: about
10-16 bytes per token and vocabulary entry, 5-8 GiB for 16 k tokens of a 32 k vocabulary. Here each chunk's logits
are computed as the plain path computes them (the matmul in the inputs' dtype, then fp32), reduced to the loss,
and -- because the loss is a scalar -- turned into that chunk's gradients with respect to h and W right away
(softmax minus one-hot, divided by the number of labels). Backward only scales the stored gradients by the
incoming one, so nothing is recomputed (the scheme of Liger-Kernel's fused linear cross-entropy, Hsu et al. 2024,
arXiv 2410.10989). At most one chunk's logits are alive; what stays is dL/dh (the size of h) and an fp32 dL/dW
(the size of the head). Gradients are only computed when autograd asks for them (not under torch.no_grad).
"""

from __future__ import annotations

import torch

IGNORE = -100  # F.cross_entropy's default ignore_index: a row without a label


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor, chunk: int) -> torch.Tensor:
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        labelled = labels_N != IGNORE
        n_labels = labelled.sum()
        scale = 1.0 / n_labels.clamp_min(1).float()  # the mean's divisor (no label: loss nan, gradients 0)
        loss_sum = h_ND.new_zeros((), dtype=torch.float32)
        grad_h = torch.empty_like(h_ND) if want_h else None
        grad_w = torch.zeros_like(w_VD, dtype=torch.float32) if want_w else None
        for start in range(0, h_ND.shape[0], chunk):
            h = h_ND[start : start + chunk]
            target = labels_N[start : start + chunk].clamp_min(0)[:, None]
            keep = labelled[start : start + chunk]
            logits = (h @ w_VD.T).float()  # [c, V], as the plain path's lm_head(h).float()
            target_logit = logits.gather(1, target)[:, 0]
            top = logits.amax(-1, keepdim=True)
            exp = logits.sub_(top).exp_()  # in place: one [c, V] buffer per chunk (logsumexp would add a second)
            total = exp.sum(-1)
            lse = top[:, 0] + total.log()
            loss_sum += ((lse - target_logit) * keep).sum()
            if want_h or want_w:
                d_logits = exp.div_(total[:, None])  # the softmax
                d_logits.scatter_add_(1, target, torch.full_like(lse[:, None], -1.0))
                d_logits.mul_((keep * scale)[:, None])
                d_logits = d_logits.to(h.dtype)
                if want_h:
                    grad_h[start : start + chunk] = d_logits @ w_VD
                if want_w and grad_w.dtype == h.dtype:
                    grad_w.addmm_(d_logits.T, h)  # fp32 inputs: accumulate in place, no [V, D] temporary
                elif want_w:
                    grad_w += (d_logits.T @ h).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.w_dtype = w_VD.dtype
        return loss_sum / n_labels

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        dh = grad_h * grad_loss.to(grad_h.dtype) if grad_h is not None else None
        dw = (grad_w * grad_loss).to(ctx.w_dtype) if grad_w is not None else None
        return dh, dw, None, None


def linear_cross_entropy(
    h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Mean cross-entropy of softmax(h W^T) against labels (IGNORE rows excluded), `chunk` rows at a time; equal to
    F.cross_entropy(F.linear(h, W).float(), labels) in value and gradients, without its [N, V] tensors."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return _LinearCrossEntropy.apply(h_ND, weight_VD, labels_N, chunk)
