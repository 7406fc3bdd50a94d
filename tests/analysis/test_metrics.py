"""The invariants of docs/analytics.md §5 on synthetic routers and traces."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest

from moe_lm.analysis import metrics as M

rng = np.random.default_rng(0)


def uniform_router(n, E, k, seed=0):
    return M.random_topk(np.random.default_rng(seed), n, E, k)


def docs_of(n, n_docs):
    return np.sort(np.random.default_rng(1).integers(0, n_docs, n))


@pytest.mark.parametrize("E, k", [(8, 2), (64, 8)])
def test_domain_shares_sum_to_k_and_one(E, k):
    experts = uniform_router(5000, E, k)
    domain = np.random.default_rng(2).integers(0, 3, 5000)
    s = M.domain_shares(experts, domain, 3, E)
    np.testing.assert_allclose(s["token_share"].sum(1), k)
    np.testing.assert_allclose(s["assignment_share"].sum(1), 1.0)
    np.testing.assert_allclose(s["relative_load"].mean(1), 1.0)


def test_coactivation_rows_and_symmetry():
    E, k = 16, 4
    experts = uniform_router(3000, E, k)
    c = M.coactivation(experts, E)
    np.testing.assert_allclose(c.sum(1), k - 1)  # every expert is active here
    n_i = M.expert_counts(experts, E)
    joint = c * n_i[:, None]
    np.testing.assert_allclose(joint, joint.T)  # N(i, j) = N(j, i)
    off = c[~np.eye(E, dtype=bool)]
    assert abs(off.mean() - (k - 1) / (E - 1)) < 0.01


def test_saturation_of_a_checkpoint_with_itself_is_one():
    experts = uniform_router(1000, 8, 2)
    assert M.saturation(experts, experts) == 1.0
    assert M.saturation(experts, experts[:, ::-1]) == 1.0  # order within the top-k does not matter
    assert abs(M.saturation(experts, uniform_router(1000, 8, 2, seed=5)) - 2 / 8) < 0.03


def test_repetition_bounds_and_pair_count():
    n, D = 4000, 37
    experts, doc = uniform_router(n, 8, 2), docs_of(n, D)
    r = M.repetition(experts, doc)
    assert r["pairs"] == n - len(np.unique(doc))
    assert 0 <= r["same_first"] <= r["topk_overlap"] <= 1
    # never pairs across a document boundary: constant routing inside documents, alternating between them
    flip = (doc % 2)[:, None] * 2 + np.array([[0, 1]])
    assert M.repetition(flip, doc)["same_first"] == 1.0


@pytest.mark.parametrize("E, k", [(8, 2), (64, 8)])
def test_max_vio_known_answers(E, k):
    N = E * 10
    round_robin = (np.arange(N * k) % E).reshape(N, k)
    assert M.max_vio(M.expert_counts(round_robin, E)) == 0.0
    same = np.tile(np.arange(k), (N, 1))
    assert M.max_vio(M.expert_counts(same, E)) == pytest.approx(E / k - 1)


def test_max_vio_floor_matches_the_notes():
    # docs/analytics.md §4: ~0.041 at E=8, k=2, N=4096 for a perfect random router
    assert M.max_vio_floor(4096, 8, 2, trials=300) == pytest.approx(0.041, abs=0.008)


def test_token_id_router_gives_full_specialisation_and_saturation():
    E, k = 16, 2
    token = np.random.default_rng(3).integers(0, 50, 20000)
    by_id = np.stack([token % E, (token + 1) % E], axis=1)  # routing is a function of the token id
    v = M.vocabulary_specialisation(by_id, token, E, min_count=20)
    assert v["observed"] == 1.0 and v["corrected"] == pytest.approx(1.0)
    assert M.saturation(by_id, by_id.copy()) == 1.0
    share, n = M.token_expert_share(by_id, token, 7, E)
    assert n == (token == 7).sum() and share[7] == 1.0 and share[8] == 1.0 and share.sum() == k


def test_vocabulary_specialisation_null_removes_the_finite_sample_bias():
    E, k = 64, 1
    token = np.random.default_rng(4).integers(0, 200, 4000)  # ~20 occurrences per id
    v = M.vocabulary_specialisation(uniform_router(4000, E, k), token, E, min_count=10)
    assert v["observed"] > 0.1  # far above the nominal 1/64 by chance alone
    assert abs(v["corrected"]) < 0.02  # the null explains it
    # docs/analytics.md §4: E=64, k=1, n=10 -> expected max share ~15.5 %
    assert M.max_share_null(10, 64, 1) == pytest.approx(0.155, abs=0.01)


@pytest.mark.parametrize("E, k", [(8, 2), (64, 8), (256, 8)])
def test_uniform_random_router_reproduces_the_baseline_table(E, k):
    n = 40000
    experts, doc = uniform_router(n, E, k), docs_of(n, 50)
    base = M.repetition_baseline(E, k)
    assert base["topk_overlap"] == pytest.approx(1 - comb(E - k, k) / comb(E, k))
    r = M.repetition(experts, doc)
    se = lambda p: 4 * np.sqrt(p * (1 - p) / r["pairs"])  # noqa: E731
    assert abs(r["same_first"] - base["same_first"]) < se(base["same_first"])
    assert abs(r["topk_overlap"] - base["topk_overlap"]) < se(base["topk_overlap"])
    s = M.domain_shares(experts, np.zeros(n, int), 1, E)["token_share"][0]
    assert abs(s.mean() - k / E) < 1e-9 and np.abs(s - k / E).max() < 6 * np.sqrt(k / E / n)
    c = M.coactivation(experts, E)[~np.eye(E, dtype=bool)]
    assert abs(c.mean() - (k - 1) / (E - 1)) < 0.005
    assert M.load_entropy(M.expert_counts(experts, E)) == pytest.approx(np.log(E), abs=0.01)


def test_document_bootstrap_interval_covers_the_estimate():
    experts, doc = uniform_router(5000, 8, 2), docs_of(5000, 40)
    r = M.repetition_with_ci(experts, doc, n_boot=300)
    lo, hi = r["same_first_ci95"]
    assert lo < r["same_first"] < hi and hi - lo < 0.1


def test_jsd_and_domain_shuffle_baseline():
    assert M.js_divergence([1, 0], [0, 1]) == pytest.approx(1.0)
    assert M.js_divergence([0.5, 0.5], [0.5, 0.5]) == 0.0
    token = np.random.default_rng(5).integers(0, 30, 3000)
    domain = (token % 3).astype(int)  # the domain is a function of the token id
    shuffled = M.shuffle_domains_within_token(token, domain)
    assert (shuffled == domain).all()  # nothing to shuffle: each id occurs in one domain only
    domain2 = np.random.default_rng(6).integers(0, 3, 3000)
    shuffled2 = M.shuffle_domains_within_token(token, domain2)
    for t in range(30):  # each token id keeps its domain mix
        assert sorted(shuffled2[token == t]) == sorted(domain2[token == t])


def test_preferred_tokens_of_a_token_id_router_are_its_own_tokens():
    """Expert = token id mod E (k = 1): each expert's preferred tokens are exactly the ids it gets, with lift =
    1 / (its base rate); tokens below min_count are left out."""
    rng = np.random.default_rng(0)
    E = 4
    token = rng.integers(0, 12, 6000)
    token[:5] = 99  # a rare token (5 occurrences, routed to expert 3)
    experts = (token % E)[:, None]
    pref = M.preferred_tokens(experts, token, E, min_count=20, top=10)
    for e in range(E):
        base = np.mean(token % E == e)
        got = {t["token"] for t in pref[e] if t["lift"] > 1}
        assert got == {t for t in range(12) if t % E == e}
        for t in pref[e]:
            if t["token"] % E == e:
                assert t["share"] == 1.0 and t["lift"] == pytest.approx(1 / base)
            else:
                assert t["share"] == 0.0 and t["lift"] == 0.0
    assert all(t["token"] != 99 for p in pref for t in p)
    assert all(p[i]["lift"] >= p[i + 1]["lift"] for p in pref for i in range(len(p) - 1))


def test_figure_layers_default_and_choice():
    from moe_lm.analysis.report import figure_layers

    assert figure_layers([1, 2, 3]) == [1, 2, 3]
    assert figure_layers(list(range(3, 61))) == [3, 32, 60]  # a DeepSeek-V3-sized stack: first, middle, last
    assert figure_layers(list(range(3, 61)), [10, 5]) == [5, 10]
    with pytest.raises(ValueError, match=r"\[2\] are not MoE layers"):
        figure_layers(list(range(3, 61)), [2])
