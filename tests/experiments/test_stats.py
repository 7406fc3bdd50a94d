"""The statistics of the experiment reports, on known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe_lm.experiments import stats


def test_t_interval_known_values():
    mean, lo, hi = stats.t_interval([1.0, 2.0, 3.0])
    half = 4.303 * 1.0 / math.sqrt(3)  # t_{0.975, 2} * sd / sqrt(n)
    assert (mean, lo, hi) == pytest.approx((2.0, 2.0 - half, 2.0 + half))
    assert stats.t_interval([0.5])[1:] == (-math.inf, math.inf)  # one seed: no interval
    assert stats.t_quantile(40) == 1.96 and stats.t_quantile(27) == 2.060


def test_bootstrap_of_a_constant_difference_is_that_constant():
    domain = np.repeat([0, 1, 2], 10)
    values = np.random.default_rng(0).normal(size=(2, 3, 30))  # [arm, seed, doc], arm b = arm a - 0.25

    def metric(arm, s, docs):
        return float(values[0, s, docs].mean() + (0.0 if arm == 0 else -0.25))

    lo, hi = stats.hierarchical_bootstrap(metric, 3, domain, n_boot=300)
    assert lo == pytest.approx(0.25) and hi == pytest.approx(0.25)


def test_bootstrap_interval_matches_the_standard_error_of_document_noise():
    """One seed, paired per-document differences with mean 0.1 and sd 1 over 400 documents in 4 domains: the
    interval is 0.1 +/- 1.96 / sqrt(400) (stratified resampling removes the between-domain part, which is 0)."""
    rng = np.random.default_rng(1)
    diff = rng.normal(0.1, 1.0, 400)
    diff += 0.1 - diff.mean()  # exactly mean 0.1 in this sample
    domain = np.repeat(np.arange(4), 100)

    def metric(arm, s, docs):
        return float(diff[docs].mean()) if arm == 0 else 0.0

    lo, hi = stats.hierarchical_bootstrap(metric, 1, domain, n_boot=2000)
    half = 1.96 * diff.std(ddof=1) / math.sqrt(400)
    assert (lo + hi) / 2 == pytest.approx(0.1, abs=0.01)
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.1)


def test_bootstrap_reflects_seed_to_seed_variation():
    """Seeds that disagree widen the interval: per-seed deltas -0.2, 0, +0.2 (no document noise)."""
    domain = np.zeros(20, dtype=int)
    per_seed = [-0.2, 0.0, 0.2]

    def metric(arm, s, docs):
        return per_seed[s] if arm == 0 else 0.0

    lo, hi = stats.hierarchical_bootstrap(metric, 3, domain, n_boot=2000)
    assert lo < -0.1 and hi > 0.1


@pytest.mark.parametrize(
    "deltas, expect, margin, verdict",
    [
        ([-0.05, -0.04, -0.06], "lower", 0.0, "supported"),
        ([-0.05, -0.04, 0.001], "lower", 0.0, "inconclusive"),  # a seed disagrees
        ([0.05, 0.04, 0.06], "lower", 0.0, "contradicted"),
        ([0.05, 0.04, 0.06], "higher", 0.0, "supported"),
        ([0.001, -0.002, 0.0005], "not_lower", 0.01, "supported"),  # no gain beyond the margin
        ([-0.05, -0.04, -0.06], "not_lower", 0.01, "contradicted"),  # a clear gain
        ([-0.02, 0.01, -0.03], "not_lower", 0.01, "inconclusive"),
        ([0.05, 0.04, 0.06], "not_higher", 0.01, "contradicted"),
    ],
)
def test_verdict_rule(deltas, expect, margin, verdict):
    _, lo, hi = stats.t_interval(deltas)
    assert stats.verdict(deltas, lo, hi, expect, margin)[0] == verdict
