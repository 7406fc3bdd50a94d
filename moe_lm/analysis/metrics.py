"""Routing metrics as pure functions of arrays (a trace's columns), each with its uniform-routing baseline.

The statistics the trainer logs too (counts, MaxVio, domain JSD, repetition hits) live below both, in
moe_lm/routing/stats.py, and are part of this module's set.

Notation: N tokens, E experts, K experts per token, D documents. `experts` is [N, K] (first choice first).
Definitions, baselines and traps: docs/analytics.md §2-§4 (sources: Mixtral §5 for repetition, OLMoE §5 for
co-activation, specialisation and saturation, DeepSeek-V3 §4.5 for relative load, Wang et al. 2024 for MaxVio).
"""

from __future__ import annotations

from functools import lru_cache
from math import comb

import numpy as np

from moe_lm.routing.stats import (  # noqa: F401 (shared with training, part of this set)
    MAX_PAIRS,
    consecutive_pairs,
    domain_jsd_table,
    expert_counts,
    js_divergence,
    max_vio,
    mean_domain_jsd,
    mean_pairwise,
    pairwise_jsd,
    repetition_hits,
)


def max_vio_floor(n_tokens: int, n_experts: int, k: int, trials: int = 200, seed: int = 0) -> float:
    """Expected MaxVio of a perfectly uniform random router over n_tokens (the finite-sample floor)."""
    rng = np.random.default_rng(seed)
    vals = [max_vio(expert_counts(random_topk(rng, n_tokens, n_experts, k), n_experts)) for _ in range(trials)]
    return float(np.mean(vals))


def random_topk(rng: np.random.Generator, n: int, n_experts: int, k: int) -> np.ndarray:
    """[n, k] uniform random k-subsets of experts (without replacement), in random order."""
    return np.argsort(rng.random((n, n_experts)), axis=1)[:, :k]


# ------------------------------------------------------------------------------------------ domains


def domain_expert_counts(experts: np.ndarray, domain: np.ndarray, n_domains: int, n_experts: int) -> np.ndarray:
    """Token-slots of each domain routed to each expert [Dm, E]."""
    K = experts.shape[1]
    counts = np.zeros((n_domains, n_experts), dtype=np.float64)
    np.add.at(counts, (np.repeat(np.asarray(domain, np.int64), K), np.asarray(experts, np.int64).ravel()), 1.0)
    return counts


def reap_saliency(
    experts: np.ndarray,
    weights: np.ndarray,
    norms: np.ndarray,
    n_experts: int,
    group: np.ndarray | None = None,
    n_groups: int = 1,
) -> np.ndarray:
    """REAP's saliency (arXiv 2510.13999) per group of rows and expert [G, E]: over the (token, slot) pairs of the
    group that chose expert j, the mean of g_j(t) * ||f_j(t)||_2 (the gate weight the combine applies times the
    expert's output norm before it); 0 where no pair chose j. `group`: [N] row -> group (None: one group)."""
    K = experts.shape[1]
    g = np.zeros(experts.shape[0], np.int64) if group is None else np.asarray(group, np.int64)
    cell = np.repeat(g, K) * n_experts + np.asarray(experts, np.int64).ravel()
    size = n_groups * n_experts
    count = np.bincount(cell, minlength=size).astype(np.float64)
    mass = np.bincount(cell, weights=(np.asarray(weights, np.float64) * np.asarray(norms, np.float64)).ravel(),
                       minlength=size)  # fmt: skip
    return np.divide(mass, count, out=np.zeros(size), where=count > 0).reshape(n_groups, n_experts)


def domain_shares(experts: np.ndarray, domain: np.ndarray, n_domains: int, n_experts: int) -> dict[str, np.ndarray]:
    """Per domain and expert [Dm, E]:
    token_share: share of the domain's tokens whose top-k contains e (rows sum to K; uniform K/E);
    assignment_share: share of the domain's assignments going to e (rows sum to 1; uniform 1/E);
    relative_load: assignment_share * E, load over balanced load (rows average to 1; DeepSeek-V3 Fig. 9)."""
    K = experts.shape[1]
    counts = domain_expert_counts(experts, domain, n_domains, n_experts)
    tokens = np.bincount(np.asarray(domain, np.int64), minlength=n_domains).astype(np.float64)[:, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        token_share = counts / tokens
        assignment = counts / (tokens * K)
    return {"token_share": token_share, "assignment_share": assignment, "relative_load": assignment * n_experts}


def shuffle_domains_within_token(token: np.ndarray, domain: np.ndarray, seed: int = 0) -> np.ndarray:
    """Domain labels permuted among the occurrences of each token id (baseline N2): keeps every token id's
    domain mix, destroys any context-dependent domain signal beyond the token's identity."""
    rng = np.random.default_rng(seed)
    token = np.asarray(token)
    order = np.argsort(token, kind="stable")
    sorted_tokens = token[order]
    shuffled = np.asarray(domain).copy()
    bounds = np.flatnonzero(np.diff(sorted_tokens)) + 1
    for group in np.split(order, bounds):
        shuffled[group] = shuffled[rng.permutation(group)]
    return shuffled


# ---------------------------------------------------------------------------------------- token ids


def token_expert_share(experts: np.ndarray, token: np.ndarray, token_id: int, n_experts: int) -> tuple[np.ndarray, int]:
    """Share of token_id's occurrences whose top-k contains each expert [E] (sums to K), and the count."""
    sel = np.asarray(token) == token_id
    n = int(sel.sum())
    if n == 0:
        return np.zeros(n_experts), 0
    return expert_counts(experts[sel], n_experts) / n, n


@lru_cache(maxsize=4096)
def max_share_null(n: int, n_experts: int, k: int, trials: int = 400) -> float:
    """Expected max over experts of the share of n random top-k routings that contain the expert."""
    rng = np.random.default_rng(n * 7919 + n_experts * 31 + k)
    picks = random_topk(rng, n * trials, n_experts, k).reshape(trials, n, k)
    counts = np.zeros((trials, n_experts))
    for t in range(trials):
        counts[t] = np.bincount(picks[t].ravel(), minlength=n_experts)
    return float((counts.max(1) / n).mean())


def vocabulary_specialisation(
    experts: np.ndarray, token: np.ndarray, n_experts: int, min_count: int = 20
) -> dict[str, float]:
    """For token ids seen at least min_count times: the max over experts of the share of the id's occurrences
    routed to the expert (1.0 = every occurrence goes to the same expert), against the finite-sample null of a
    uniform random router with the same count, and the chance-corrected score (obs - null) / (1 - null)."""
    K = experts.shape[1]
    token = np.asarray(token)
    ids, inverse, counts = np.unique(token, return_inverse=True, return_counts=True)
    keep = counts >= min_count
    if not keep.any():
        return {"tokens": 0, "observed": float("nan"), "null": float("nan"), "corrected": float("nan")}
    per = np.zeros((len(ids), n_experts))
    np.add.at(per, (np.repeat(inverse, K), np.asarray(experts, np.int64).ravel()), 1.0)
    obs = per.max(1) / counts
    null = np.zeros(len(ids))
    null[keep] = [max_share_null(int(min(c, 2000)), n_experts, K) for c in counts[keep]]
    keep &= null < 1  # why: where chance alone gives every occurrence one expert (k = E), nothing is corrected
    if not keep.any():
        return {"tokens": 0, "observed": float("nan"), "null": float("nan"), "corrected": float("nan")}
    o, null = obs[keep], null[keep]
    w = counts[keep] / counts[keep].sum()
    return {
        "tokens": int(keep.sum()),
        "min_count": min_count,
        "observed": float((w * o).sum()),
        "null": float((w * null).sum()),
        "corrected": float((w * (o - null) / (1 - null)).sum()),
    }


def preferred_tokens(
    experts: np.ndarray, token: np.ndarray, n_experts: int, min_count: int = 20, top: int = 10
) -> list[list[dict]]:
    """Per expert, its most preferred token ids: those (seen at least min_count times) whose occurrences pick the
    expert most often relative to its base rate. lift = P(e in top-k | token) / P(e in top-k); 1 = no preference,
    E/K = every occurrence of the token picks e while e takes the uniform share. Ties: the more frequent first."""
    K = experts.shape[1]
    token = np.asarray(token)
    ids, inverse, counts = np.unique(token, return_inverse=True, return_counts=True)
    per = np.zeros((len(ids), n_experts))
    np.add.at(per, (np.repeat(inverse, K), np.asarray(experts, np.int64).ravel()), 1.0)
    share = per / counts[:, None]  # P(e in top-k | token)
    base = per.sum(0) / len(token)  # P(e in top-k)
    keep = counts >= min_count
    out = []
    for e in range(n_experts):
        if base[e] == 0 or not keep.any():
            out.append([])
            continue
        lift = np.where(keep, share[:, e] / base[e], -np.inf)
        order = np.lexsort((-counts, -lift))[: min(top, int(keep.sum()))]
        out.append(
            [
                {"token": int(ids[i]), "count": int(counts[i]), "share": float(share[i, e]), "lift": float(lift[i])}
                for i in order
            ]  # fmt: skip
        )
    return out


# ------------------------------------------------------------------------------------ consecutive tokens


def repetition(experts: np.ndarray, doc: np.ndarray) -> dict[str, float]:
    """Mixtral Table 5: share of adjacent tokens (same document) with the same first choice, and with
    overlapping top-k sets; pairs never cross a document boundary."""
    return _rates(*repetition_hits(experts, doc))


def _rates(t: np.ndarray, same_first: np.ndarray, overlap: np.ndarray) -> dict[str, float]:
    return {"pairs": int(len(t)), "same_first": float(same_first.mean()), "topk_overlap": float(overlap.mean())}


def repetition_baseline(n_experts: int, k: int) -> dict[str, float]:
    """Uniform random routing: same first choice 1/E; overlapping top-k 1 - C(E-k, k) / C(E, k)."""
    return {"same_first": 1 / n_experts, "topk_overlap": 1 - comb(n_experts - k, k) / comb(n_experts, k)}


# ------------------------------------------------------------------------------- co-activation, entropy


def coactivation(experts: np.ndarray, n_experts: int) -> np.ndarray:
    """[E, E] N(i, j) / N(i) over all pairs in each token's top-k (OLMoE Eq. 4, every pair, not only adjacent
    ranks); rows of active experts sum to K - 1; uniform baseline (K - 1) / (E - 1) off the diagonal."""
    experts = np.asarray(experts, np.int64)
    onehot = np.zeros((len(experts), n_experts), dtype=np.float64)
    np.put_along_axis(onehot, experts, 1.0, axis=1)
    joint = onehot.T @ onehot  # N(i, j), diagonal N(i)
    n_i = np.diag(joint).copy()
    np.fill_diagonal(joint, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n_i[:, None] > 0, joint / n_i[:, None], 0.0)


def load_entropy(counts: np.ndarray) -> float:
    """Entropy (nats) of the expert-load distribution; ln E when perfectly balanced."""
    p = np.asarray(counts, np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


def dead_experts(counts: np.ndarray, threshold: float = 0.01) -> list[int]:
    """Experts whose load is below `threshold` of the balanced load."""
    counts = np.asarray(counts, np.float64)
    return np.flatnonzero(counts < threshold * counts.mean()).tolist()


def saturation(experts_a: np.ndarray, experts_b: np.ndarray) -> float:
    """Router saturation (OLMoE Eq. 5): mean over tokens of |topk_a ∩ topk_b| / K for the same tokens routed by
    two checkpoints; 1 = identical decisions, uniform baseline K / E."""
    a, b = np.asarray(experts_a), np.asarray(experts_b)
    return float((a[:, :, None] == b[:, None, :]).any(axis=2).sum(1).mean() / a.shape[1])


# -------------------------------------------------------------------------------------------- bootstrap


def per_document_sums(values: np.ndarray, doc_of_value: np.ndarray, n_docs: int) -> np.ndarray:
    """Sum of `values` per document [D] (for bootstrap intervals over documents)."""
    return np.bincount(np.asarray(doc_of_value, np.int64), weights=np.asarray(values, np.float64), minlength=n_docs)


def bootstrap_ratio(numer: np.ndarray, denom: np.ndarray, n_boot: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of sum(numer) / sum(denom) resampling whole documents (their tokens are correlated, so a
    bootstrap over tokens would be too narrow). numer/denom: per-document sums [D]."""
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(numer), (n_boot, len(numer)))
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = numer[pick].sum(1) / denom[pick].sum(1)
    lo, hi = np.nanpercentile(ratios, [2.5, 97.5])
    return float(lo), float(hi)


def repetition_with_ci(experts: np.ndarray, doc: np.ndarray, n_boot: int = 1000, ranked: bool = True) -> dict:
    """repetition() plus document-bootstrap 95 % intervals for both rates; `ranked` False (experts as sets): no
    first choice, `same_first` None."""
    t, same_first, overlap = repetition_hits(experts, doc)
    result = _rates(t, same_first, overlap)
    if not ranked:
        result["same_first"] = None
    if len(t) == 0:
        return result
    pair_doc = np.asarray(doc)[t]
    n_docs = int(np.asarray(doc).max()) + 1
    pairs = per_document_sums(np.ones(len(t)), pair_doc, n_docs)
    has = pairs > 0
    for name, hit in (("same_first", same_first), ("topk_overlap", overlap)):
        if result[name] is None:
            continue
        lo, hi = bootstrap_ratio(per_document_sums(hit, pair_doc, n_docs)[has], pairs[has], n_boot)
        result[f"{name}_ci95"] = [lo, hi]
    return result
