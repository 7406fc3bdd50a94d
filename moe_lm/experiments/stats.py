"""Statistics of a seed-paired comparison: a t-interval over seeds, a hierarchical bootstrap over seeds and
documents, and the verdict rule fixed before the runs.

Arms are paired by seed id (the seed fixes the initialisation and the data order; a seed one arm lacks is an
error) and by document (every arm is scored on the same validation documents). For delta = metric(a) - metric(b):
- the t-interval of the per-seed deltas (n seeds, n - 1 degrees of freedom, exact Student quantiles): what the
  verdict uses and what is reported beside it, because seed-to-seed variation is the largest source of noise at
  this scale;
- a hierarchical bootstrap (seeds, then documents within each domain): kept in results.json, labelled as such and
  never beside a verdict — with 3-5 seeds resampling seeds gives about their min-max, far narrower than the
  t-interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from moe_lm.errors import DataError


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with df degrees of freedom, through the regularized incomplete beta function."""
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2, 0.5, x)
    return 1 - tail if t > 0 else tail


def t_quantile(df: int, p: float = 0.975) -> float:
    """The p-quantile of Student's t with df degrees of freedom, exact to 1e-10 for every df (bisection on t_cdf)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    lo, hi = -1e3, 1e3
    if df == 1:  # the Cauchy distribution: closed form (its tails reach past the bracket)
        return math.tan(math.pi * (p - 0.5))
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) by its continued fraction (Lentz's method; Numerical Recipes 6.4)."""
    if x <= 0 or x >= 1:
        return float(x >= 1)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast below this point: use the symmetry
        return 1 - _betainc(b, a, 1 - x)
    tiny, c, d = 1e-300, 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # fmt: skip
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return front * f / a


def paired_deltas(a: dict[int, float], b: dict[int, float], what: str = "") -> tuple[list[int], list[float]]:
    """(seeds, a[seed] - b[seed]) over the seeds both arms have; a seed that only one arm has is an error (its
    partner run is missing: pairing by position would pair different seeds)."""
    alone = sorted(set(a) ^ set(b))
    if alone:
        raise DataError(f"{what}: seeds {alone} are in one arm only; run the missing seeds (--seeds) first")
    seeds = sorted(a)
    return seeds, [a[s] - b[s] for s in seeds]


def t_interval(deltas: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) two-sided `level` interval of the mean of per-seed deltas; with one seed it is unbounded."""
    d = np.asarray(deltas, dtype=float)
    mean = float(d.mean())
    if len(d) < 2:
        return mean, -math.inf, math.inf
    half = t_quantile(len(d) - 1, 0.5 + level / 2) * float(d.std(ddof=1)) / math.sqrt(len(d))
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


def decide(low, high, low90, high90, all_below, all_above, expect: str, margin: float = 0.0):
    """(supported, contradicted) of the verdict rule, elementwise over arrays of pilots or simulated designs: the
    95 % interval (low, high), the 90 % one (for `equivalent`), and whether every seed's delta is below / above 0.
    One rule for `verdict` and for the power of a design (moe_lm/experiments/power.py)."""
    low, high, low90, high90 = map(np.asarray, (low, high, low90, high90))
    if expect == "lower":
        return (high < 0) & np.asarray(all_below), low > 0
    if expect == "higher":
        return (low > 0) & np.asarray(all_above), high < 0
    if expect == "not_lower":
        return low > -margin, high < -margin
    if expect == "not_higher":
        return high < margin, low > margin
    if expect == "equivalent":
        return (-margin < low90) & (high90 < margin), (low > margin) | (high < -margin)
    raise ValueError(f"unknown expectation {expect!r}")


def verdict(deltas: list[float], low: float, high: float, expect: str, margin: float = 0.0) -> tuple[str, str]:
    """(supported | contradicted | inconclusive, why) for delta = a - b, fixed before the runs, from the 95 %
    t-interval (low, high):

    - lower (a < b): supported if the interval lies below 0 and every seed agrees; contradicted if it lies above 0;
    - higher: the mirror image;
    - not_lower (a does not beat b by more than `margin`): contradicted if the interval lies below -margin (a clear
      gain); supported if it lies above -margin; not_higher: the mirror image;
    - equivalent (|delta| < margin, two one-sided tests at 5 % each): supported if the 90 % t-interval lies inside
      (-margin, +margin); contradicted if the 95 % interval lies wholly outside it;
    - otherwise inconclusive, with the resolution (the interval's half-width). For not_* and equivalent, a
      resolution wider than the margin is named: the design cannot support the claim whatever the truth.
    """
    half = (high - low) / 2
    resolution = f"resolution +/- {half:.4f}"
    if expect in ("not_lower", "not_higher", "equivalent") and half > margin:
        resolution += f", wider than the margin {margin}: underpowered"
    d = np.asarray(deltas)
    _, lo90, hi90 = t_interval(deltas, level=0.90)
    supported, contradicted = decide(low, high, lo90, hi90, (d < 0).all(), (d > 0).all(), expect, margin)
    why = {
        "lower": (f"the interval lies below 0 and all {len(d)} seeds agree", "the interval lies above 0"),
        "higher": (f"the interval lies above 0 and all {len(d)} seeds agree", "the interval lies below 0"),
        "not_lower": (f"any gain is smaller than the margin {margin} (the interval lies above -{margin})",
                      f"a gain beyond the margin {margin}: the interval lies below -{margin}"),
        "not_higher": (f"any loss is smaller than the margin {margin} (the interval lies below {margin})",
                       f"a loss beyond the margin {margin}: the interval lies above {margin}"),
        "equivalent": (f"equivalent within {margin}: the 90 % interval (TOST) lies inside +/- {margin}",
                       f"an effect beyond the margin {margin}: the 95 % interval lies outside +/- {margin}"),
    }[expect]  # fmt: skip
    if contradicted:
        return "contradicted", why[1]
    if supported:
        return "supported", why[0]
    if expect == "equivalent":
        return "inconclusive", f"the interval reaches past the margin ({resolution})"
    return "inconclusive", f"the interval includes the threshold ({resolution})"


def mean_sd(values) -> str:
    """ "mean ± sd" of per-seed values (the sample sd), as a report's cell; the mean alone for one seed."""
    v = np.asarray(values, dtype=float)
    if len(v) < 2:
        return f"{v.mean():.4f}"
    return f"{v.mean():.4f} ± {v.std(ddof=1):.4f}"
