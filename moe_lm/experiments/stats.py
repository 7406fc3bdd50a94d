"""Statistics of a seed-paired comparison: a t-interval over seeds, a hierarchical bootstrap over seeds and
documents, and the verdict rule fixed before the runs.

Arms are paired by seed (the seed fixes the initialisation and the data order) and by document (every arm is
scored on the same validation documents). Two intervals are reported for delta = metric(a) - metric(b):
- the t-interval of the per-seed deltas (n seeds, n - 1 degrees of freedom): what the verdict uses, because seed
  to seed variation is the largest source of noise at this scale and 3 seeds cannot be bootstrapped honestly;
- a hierarchical bootstrap: resample seeds, then documents within each domain (the same documents for both arms),
  which adds the uncertainty of the finite validation set.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

# two-sided 95 % quantiles of Student's t, by degrees of freedom (beyond 30: the normal 1.96)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 25: 2.060, 30: 2.042}  # fmt: skip


def t_quantile(df: int) -> float:
    if df in T975:
        return T975[df]
    return T975[max(k for k in T975 if k <= df)] if df < 30 else 1.96


def t_interval(deltas: list[float]) -> tuple[float, float, float]:
    """(mean, low, high) 95 % interval of the mean of per-seed deltas; with one seed the interval is unbounded."""
    d = np.asarray(deltas, dtype=float)
    mean = float(d.mean())
    if len(d) < 2:
        return mean, -math.inf, math.inf
    half = t_quantile(len(d) - 1) * float(d.std(ddof=1)) / math.sqrt(len(d))
    return mean, mean - half, mean + half


def hierarchical_bootstrap(
    metric: Callable[[int, int, np.ndarray], float],
    n_seeds: int,
    doc_domain: np.ndarray,
    n_boot: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """95 % interval of the seed-averaged delta. `metric(arm, seed_index, docs)` is the arm's (0 = a, 1 = b) metric
    on a multiset of document indices; each draw resamples seeds, then documents within each domain, and uses the
    same documents for both arms."""
    rng = np.random.default_rng(seed)
    by_domain = [np.flatnonzero(doc_domain == d) for d in np.unique(doc_domain)]
    draws = np.empty(n_boot)
    for b in range(n_boot):
        seeds = rng.integers(0, n_seeds, n_seeds)
        total = 0.0
        for s in seeds:
            docs = np.concatenate([idx[rng.integers(0, len(idx), len(idx))] for idx in by_domain])
            total += metric(0, s, docs) - metric(1, s, docs)
        draws[b] = total / n_seeds
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return float(lo), float(hi)


def verdict(deltas: list[float], low: float, high: float, expect: str, margin: float = 0.0) -> tuple[str, str]:
    """(supported | contradicted | inconclusive, why) for delta = a - b, fixed before the runs:

    - lower (a < b): supported if the interval lies below 0 and every seed agrees; contradicted if it lies above 0;
    - higher: the mirror image;
    - not_lower (a does not beat b by more than `margin`): contradicted if the interval lies below -margin (a clear
      gain); supported if it lies above -margin; not_higher: the mirror image;
    - otherwise inconclusive, with the resolution (the interval's half-width).
    """
    half = (high - low) / 2
    resolution = f"resolution +/- {half:.4f}"
    d = np.asarray(deltas)
    if expect == "lower":
        if high < 0 and (d < 0).all():
            return "supported", f"the interval lies below 0 and all {len(d)} seeds agree"
        if low > 0:
            return "contradicted", "the interval lies above 0"
    elif expect == "higher":
        if low > 0 and (d > 0).all():
            return "supported", f"the interval lies above 0 and all {len(d)} seeds agree"
        if high < 0:
            return "contradicted", "the interval lies below 0"
    elif expect == "not_lower":
        if high < -margin:
            return "contradicted", f"a gain beyond the margin {margin}: the interval lies below -{margin}"
        if low > -margin:
            return "supported", f"any gain is smaller than the margin {margin} (the interval lies above -{margin})"
    elif expect == "not_higher":
        if low > margin:
            return "contradicted", f"a loss beyond the margin {margin}: the interval lies above {margin}"
        if high < margin:
            return "supported", f"any loss is smaller than the margin {margin} (the interval lies below {margin})"
    else:
        raise ValueError(f"unknown expectation {expect!r}")
    return "inconclusive", f"the interval includes the threshold ({resolution})"
