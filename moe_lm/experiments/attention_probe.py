"""Attention-matrix probe: every layer's and head's A = softmax(Q K^T * scale + mask), in float64, and its rank.

The claim under test (Su Jianlin, kexue.fm/archives/9529): a bidirectional attention matrix is softmax of an
(n x d)(d x n) product and so tends to low rank, while a causal one is lower-triangular with a positive diagonal
and so is always full rank. Measured per matrix (singular values s_1 >= ... >= s_n):
- exact rank of a causal (lower-triangular) matrix: its determinant is the product of its diagonal, so it is
  exactly nonsingular iff no diagonal entry is 0 (in float64, iff none underflowed): `nonzero_diagonal` = n;
- numerical rank #{s_i >= tau * s_1} at tau = n * eps_float64 (`rank_eps`), 1e-6 and 1e-3. A triangular matrix can
  be exactly nonsingular and still numerically rank-deficient: its condition number can grow exponentially with n
  (Viswanath & Trefethen 1998), so s_min falls below n * eps * s_1;
- effective rank exp(-sum p_i ln p_i), p_i = s_i / sum s (Roy & Vetterli 2007): how many directions carry weight;
- stable rank ||A||_F^2 / s_1^2, the smallest singular value, and for causal matrices the smallest diagonal entry
  (for a triangular matrix s_min <= min |diagonal|: a previous-token head is full rank only on paper);
- the logits Q K^T * scale before the softmax (`attention_logits`): their rank is at most the head dimension, the
  bottleneck Su's argument starts from;
- on hidden states, the rank-collapse measure of Dong et al. 2021 (arXiv 2103.03404): the relative residual
  ||X - 1 mean(X)^T||_F / ||X||_F of a sequence's representations (0 = every position the same vector), for the
  model itself and for its attention-only path (the first layer's input multiplied by each layer's head-averaged
  A in turn, without skips or MLPs: where Dong et al. prove the collapse).

The probe hooks each attention layer's kernel module (moe_lm.model.attention.ScaledDotProductAttention, a public
forward hook) for the duration of a forward pass and recomputes A from the same q, k, mask and scale; the model code
is untouched.
"""

from __future__ import annotations

import contextlib
import math

import torch

from moe_lm.data.batches import eval_windows
from moe_lm.data.prepare import load_split
from moe_lm.model.attention import ScaledDotProductAttention

EPS64 = torch.finfo(torch.float64).eps


@contextlib.contextmanager
def capture_attention(model: torch.nn.Module, store: list):
    """Within the block, every attention call of `model` appends (q, k, v, mask, scale, enable_gqa) to `store` (in
    layer order within a forward pass)."""

    def probe(module, args, kwargs, output):
        q, k, v, mask, scale, *gqa = (*args, *kwargs.values())
        store.append((q.detach(), k.detach(), v.detach(), mask, scale, bool(gqa and gqa[0])))

    kernels = [m for m in model.modules() if isinstance(m, ScaledDotProductAttention)]
    hooks = [m.register_forward_hook(probe, with_kwargs=True) for m in kernels]
    try:
        yield store
    finally:
        for hook in hooks:
            hook.remove()


def attention_logits(q, k, scale: float, enable_gqa: bool = False) -> torch.Tensor:
    """Q K^T * scale [B, H, S, L] in float64, before any mask, from q [B, H, S, dq] and k [B, Hkv, L, dq]."""
    if enable_gqa and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return (q.double() @ k.double().transpose(-1, -2)) * scale


def attention_matrices(q, k, mask, scale: float, enable_gqa: bool = False) -> torch.Tensor:
    """A [B, H, S, L] in float64 from q [B, H, S, dq], k [B, Hkv, L, dq] and a boolean mask (None = causal)."""
    logits = attention_logits(q, k, scale, enable_gqa)
    S, L = logits.shape[-2:]
    if mask is None:
        mask = torch.ones(S, L, dtype=torch.bool).tril(L - S)
    return logits.masked_fill(~mask, float("-inf")).softmax(-1)


def rank_metrics(A: torch.Tensor, taus: tuple[float, ...] = (1e-6, 1e-3)) -> dict[str, torch.Tensor]:
    """Per matrix of A [..., n, n] (float64): numerical ranks, effective and stable rank, s_min, and the diagonal
    (nonzero entries and the smallest; for a triangular matrix these decide its exact rank)."""
    s = torch.linalg.svdvals(A)
    n = A.shape[-1]
    top = s[..., :1]
    diagonal = A.diagonal(dim1=-2, dim2=-1)
    out = {"nonzero_diagonal": (diagonal > 0).sum(-1), "min_diagonal": diagonal.min(-1).values}
    out["rank_eps"] = (s >= n * EPS64 * top).sum(-1)
    for tau in taus:
        out[f"rank_{tau:g}"] = (s >= tau * top).sum(-1)
    p = s / s.sum(-1, keepdim=True)
    out["erank"] = torch.exp(-(p * torch.log(p.clamp_min(1e-300))).sum(-1))
    out["stable_rank"] = (s**2).sum(-1) / top[..., 0] ** 2
    out["s_min"] = s[..., -1]
    return out


@torch.no_grad()
def erank_by_layer(model: torch.nn.Module, windows: torch.Tensor, batch: int = 8, forward=None) -> list[float]:
    """Per attention layer of `model`, the effective rank of its full attention matrices (mean over heads and
    windows) while `forward(chunk)` (default: `model(chunk)`) runs it on chunks of `windows`: the caller decides the
    inputs (an MLM its masked ones)."""
    forward = forward or model
    sums: list[float] = []
    count = 0
    for chunk in windows.split(batch):
        store = []
        with capture_attention(model, store):
            forward(chunk)
        sums = sums or [0.0] * len(store)
        for layer, (q, k, _, mask, scale, gqa) in enumerate(store):
            erank = rank_metrics(attention_matrices(q, k, mask, scale, gqa))["erank"]  # [B, H]
            sums[layer] += erank.sum().item()
        count += erank.numel()
    return [s / count for s in sums]


def relative_residual(x_BSD: torch.Tensor) -> torch.Tensor:
    """Dong et al.'s rank-collapse measure per sequence [B]: ||X - 1 mean(X)^T||_F / ||X||_F."""
    x = x_BSD.double()
    return (x - x.mean(1, keepdim=True)).flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1)


def synthetic_erank(n: int, d: int, scales: list[float], seed: int = 0, trials: int = 8) -> dict[str, list[float]]:
    """Control without any model: Gaussian Q, K [n, d], effective rank of softmax(scale * Q K^T / sqrt(d)) for a
    causal and a bidirectional mask, mean over trials, per logit scale."""
    gen = torch.Generator().manual_seed(seed)
    out = {"causal": [], "bidirectional": []}
    for scale in scales:
        er = {"causal": [], "bidirectional": []}
        for _ in range(trials):
            q = torch.randn(1, 1, n, d, generator=gen, dtype=torch.float64)
            k = torch.randn(1, 1, n, d, generator=gen, dtype=torch.float64)
            s = scale / math.sqrt(d)
            er["causal"].append(rank_metrics(attention_matrices(q, k, None, s))["erank"].item())
            full = torch.ones(n, n, dtype=torch.bool)
            er["bidirectional"].append(rank_metrics(attention_matrices(q, k, full, s))["erank"].item())
        for kind in out:
            out[kind].append(sum(er[kind]) / trials)
    return out


def probe_windows(cfg, n: int) -> torch.Tensor:
    """n fixed validation windows [n, seq_len + 1], taken round-robin over the domains."""
    sets = list(eval_windows(load_split(cfg.data.out_dir, "val"), cfg.train.seq_len, n).values())
    full = [w for w in sets if w.shape[1] == cfg.train.seq_len + 1]
    picked = [s[i] for i in range(n) for s in full if i < len(s)][:n]
    return torch.stack(picked)
