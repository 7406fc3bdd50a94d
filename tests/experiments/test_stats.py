"""The statistics of the experiment reports, on known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe_lm.experiments import stats


def test_t_interval_known_values():
    mean, lo, hi = stats.t_interval([1.0, 2.0, 3.0])
    half = 4.302652729749464 * 1.0 / math.sqrt(3)  # t_{0.975, 2} * sd / sqrt(n)
    assert (mean, lo, hi) == pytest.approx((2.0, 2.0 - half, 2.0 + half))
    assert stats.t_interval([0.5])[1:] == (-math.inf, math.inf)  # one seed: no interval


def test_t_quantiles_are_exact_for_every_df():
    """Against closed forms (df 1: the Cauchy tan; df 2: (2p - 1) / sqrt(2p(1 - p)); df -> inf: the normal) and
    scipy's Student t for df 1..200 at both levels the reports use."""
    from statistics import NormalDist

    from scipy.stats import t

    for p in (0.975, 0.95):
        assert stats.t_quantile(1, p) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-12)
        assert stats.t_quantile(2, p) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-10)
        assert stats.t_quantile(10**6, p) == pytest.approx(NormalDist().inv_cdf(p), rel=1e-5)
        for df in range(1, 201):
            assert stats.t_quantile(df, p) == pytest.approx(t.ppf(p, df), rel=1e-9), (df, p)
    assert stats.t_quantile(40) == pytest.approx(2.0211, abs=1e-4)  # not the normal's 1.96


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
        ([0.001, -0.001, 0.0005, 0.0002], "equivalent", 0.01, "supported"),  # TOST: inside +/- margin
        ([0.05, 0.04, 0.06], "equivalent", 0.01, "contradicted"),  # wholly above +margin
        ([-0.05, -0.04, -0.06], "equivalent", 0.01, "contradicted"),  # two-sided: wholly below -margin too
        ([0.012, -0.004, 0.02], "equivalent", 0.01, "inconclusive"),
    ],
)
def test_verdict_rule(deltas, expect, margin, verdict):
    _, lo, hi = stats.t_interval(deltas)
    assert stats.verdict(deltas, lo, hi, expect, margin)[0] == verdict


def test_equivalence_uses_the_90_percent_interval_and_names_an_underpowered_design():
    """TOST at 5 % each side is the 90 % interval inside the margin band: a case where the 95 % interval reaches past
    the margin but the 90 % one does not is supported; a margin below the resolution is named underpowered."""
    deltas = [0.004, -0.002, 0.001, 0.006, -0.001]
    _, lo95, hi95 = stats.t_interval(deltas)
    _, lo90, hi90 = stats.t_interval(deltas, level=0.90)
    margin = (hi90 + hi95) / 2  # between the two upper ends
    assert hi90 < margin < hi95
    assert stats.verdict(deltas, lo95, hi95, "equivalent", margin)[0] == "supported"
    verdict, why = stats.verdict([0.02, -0.03, 0.01], *stats.t_interval([0.02, -0.03, 0.01])[1:], "not_lower", 0.001)
    assert verdict == "inconclusive" and "underpowered" in why


def test_deltas_are_paired_by_seed_id():
    seeds, deltas = stats.paired_deltas({2: 1.0, 0: 3.0, 1: 2.0}, {0: 1.0, 1: 1.5, 2: 0.0}, "x")
    assert seeds == [0, 1, 2] and deltas == [2.0, 0.5, 1.0]  # by id, whatever the order the runs came in
    with pytest.raises(ValueError, match=r"x: seeds \[2\] are in one arm only"):
        stats.paired_deltas({0: 1.0, 1: 2.0, 2: 3.0}, {0: 1.0, 1: 1.0}, "x")


def test_overall_verdict_with_premises_and_exploratory_runs():
    from moe_lm.experiments.report import overall

    def c(role, verdict):
        return {"role": role, "verdict": verdict}

    assert overall([c("claim", "supported"), c("context", "contradicted")]) == "supported"
    assert overall([c("claim", "supported"), c("claim", "contradicted")]) == "contradicted"
    assert overall([c("claim", "supported"), c("claim", "inconclusive")]) == "inconclusive"
    # a premise not met: the claim is not judged, whatever its own row says
    assert overall([c("premise", "contradicted"), c("claim", "contradicted")]) == "premise not met"
    assert overall([c("premise", "inconclusive"), c("claim", "supported")]) == "premise not met"
    assert overall([c("premise", "supported"), c("claim", "supported")]) == "supported"
    assert overall([c("claim", "supported")], exploratory="--seeds 2") == "exploratory (no verdict)"
