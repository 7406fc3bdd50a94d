"""Routing statistics shared by training and analysis, as pure functions of arrays: expert counts and MaxVio
(balance), the Jensen-Shannon divergence between domains' expert distributions (specialisation), adjacent-token
repetition (Mixtral §5), and each decision's margin (how near a tie it was). The trainer logs them
(moe_lm/train/balance.py, evaluate.py); the routing report adds its baselines and intervals around the same
functions (moe_lm/analysis/metrics.py). Definitions: docs/analytics.md.

Notation: N tokens, E experts, K experts per token. `experts` is [N, K] (first choice first).
"""

from __future__ import annotations

import numpy as np


def max_vio(counts: np.ndarray) -> float:
    """MaxVio = (max_i c_i - mean c) / mean c over experts (Wang et al. 2024); 0 is perfect balance."""
    counts = np.asarray(counts, dtype=np.float64)
    mean = counts.mean()
    return float((counts.max() - mean) / mean) if mean > 0 else 0.0


def expert_counts(experts: np.ndarray, n_experts: int) -> np.ndarray:
    """Token-slots per expert [E]."""
    return np.bincount(np.asarray(experts).ravel(), minlength=n_experts)


def js_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon divergence in bits between two distributions (0 = identical, 1 = disjoint)."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    m = 0.5 * (p + q)

    def kl(a, b):
        mask = a > 0
        return float((a[mask] * np.log2(a[mask] / b[mask])).sum())

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def jsd_rows(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """[n] JSD (bits) between the rows of two [n, E] matrices of distributions: H(m) - (H(p) + H(q)) / 2."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    return _entropy_bits(0.5 * (p + q)) - 0.5 * (_entropy_bits(p) + _entropy_bits(q))


def _entropy_bits(rows: np.ndarray) -> np.ndarray:
    logs = np.log2(rows, out=np.zeros_like(rows), where=rows > 0)
    return np.maximum(-(rows * logs).sum(-1), 0.0)


PAIR_BLOCK = 1 << 16  # pairs evaluated at once: [PAIR_BLOCK, E] float64 arrays


def pairwise_jsd(dist: np.ndarray) -> np.ndarray:
    """[Dm, Dm] JSD (bits) between the rows of a [Dm, E] matrix of distributions."""
    n = len(dist)
    out = np.zeros((n, n))
    i, j = np.triu_indices(n, 1)
    for start in range(0, len(i), PAIR_BLOCK):
        a, b = i[start : start + PAIR_BLOCK], j[start : start + PAIR_BLOCK]
        out[a, b] = out[b, a] = np.maximum(jsd_rows(dist[a], dist[b]), 0.0)
    return out


def domain_jsd_table(counts_DE: np.ndarray) -> np.ndarray:
    """Pairwise JSD (bits) between the expert-assignment distributions of the domains that have tokens, from
    their counts [Dm, E] (`domain_expert_counts`); domains without tokens are left out, not compared as zeros."""
    return pairwise_jsd(_present_distributions(counts_DE))


def _present_distributions(counts_DE: np.ndarray) -> np.ndarray:
    counts_DE = np.asarray(counts_DE, np.float64)
    present = counts_DE[counts_DE.sum(1) > 0]
    return present / present.sum(1, keepdims=True)


MAX_PAIRS = 20_000  # every pair up to this many (200 domains), else this many drawn at random (seeded)


def mean_domain_jsd(counts_DE: np.ndarray, max_pairs: int = MAX_PAIRS, seed: int = 0) -> float:
    """The mean JSD (bits) over pairs of the domains that have tokens, in time linear in the domains: every pair up
    to `max_pairs` pairs, else the mean over `max_pairs` pairs drawn uniformly (with replacement, `seed`: the same
    pairs for the same number of domains, so a baseline is drawn on the pairs of its metric). 0 for one domain."""
    dist = _present_distributions(counts_DE)
    n = len(dist)
    if n < 2:
        return 0.0
    if n * (n - 1) // 2 <= max_pairs:
        i, j = np.triu_indices(n, 1)
    else:
        rng = np.random.default_rng(seed)
        i = rng.integers(0, n, max_pairs)
        j = (i + rng.integers(1, n, max_pairs)) % n  # another domain, uniformly
    return float(np.mean(np.concatenate([
        np.maximum(jsd_rows(dist[i[s : s + PAIR_BLOCK]], dist[j[s : s + PAIR_BLOCK]]), 0.0)
        for s in range(0, len(i), PAIR_BLOCK)
    ])))  # fmt: skip


def mean_pairwise(matrix: np.ndarray) -> float:
    n = len(matrix)
    return float(matrix[np.triu_indices(n, 1)].mean()) if n > 1 else 0.0


def consecutive_pairs(doc: np.ndarray) -> np.ndarray:
    """Indices t such that tokens t and t + 1 are adjacent in the same document (N - D of them)."""
    doc = np.asarray(doc)
    return np.flatnonzero(doc[1:] == doc[:-1])


def repetition_hits(experts: np.ndarray, doc: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the P adjacent same-document pairs (t, t + 1): t [P], same first choice [P], overlapping top-k [P]."""
    t = consecutive_pairs(doc)
    a, b = np.asarray(experts[t]), np.asarray(experts[t + 1])
    return t, a[:, 0] == b[:, 0], (a[:, :, None] == b[:, None, :]).any(axis=(1, 2))


def decision_margins(scores: np.ndarray, k: int, n_groups: int = 1, groups_used: int = 1) -> np.ndarray:
    """Each token's decision margin from its selection scores [N, E] (the biased ones when a selection-only bias is
    used): the k-th minus the (k+1)-th score among the experts of the kept groups, and with group-limited routing
    also the smallest kept group's score minus the best dropped group's (a group's score: the sum of its two best
    experts', DeepSeek-V3's rule), whichever is smaller. A decision this close to a tie can flip under any change
    of rounding (another engine, a quantised file), whatever the expert margin says."""
    s = np.asarray(scores, dtype=np.float64)
    N, E = s.shape
    margin = np.full(N, np.inf)
    if n_groups > 1 and groups_used < n_groups:
        group_scores = np.sort(s.reshape(N, n_groups, E // n_groups), axis=2)[:, :, -2:].sum(axis=2)  # [N, G]
        ranked_groups = -np.sort(-group_scores, axis=1)
        margin = ranked_groups[:, groups_used - 1] - ranked_groups[:, groups_used]
        kept = np.argsort(-group_scores, axis=1, kind="stable")[:, :groups_used]
        in_kept = np.zeros((N, n_groups), bool)
        np.put_along_axis(in_kept, kept, True, axis=1)
        s = np.where(np.repeat(in_kept, E // n_groups, axis=1), s, -np.inf)
    if k < E:
        ranked = -np.sort(-s, axis=1)
        margin = np.minimum(margin, ranked[:, k - 1] - ranked[:, k])
    return margin
