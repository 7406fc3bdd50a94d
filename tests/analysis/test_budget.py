"""A token budget covers every domain: equal shares, the rest of a thin domain's share given to the others."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_lm.analysis.budget import budget_document_count, budget_documents, equal_shares


def reference_shares(available: list[int], budget: int) -> list[int]:
    """The definition, by search: the largest common cap t with sum(min(a, t)) <= budget, then the remainder one
    unit at a time to the earliest domains that still have text."""
    t = 0
    while t < max(available, default=0) and sum(min(a, t + 1) for a in available) <= budget:
        t += 1
    quota = [min(a, t) for a in available]
    for d in range(len(available)):
        extra = min(budget - sum(quota), available[d] - quota[d])
        quota[d] += extra
    return quota


@pytest.mark.parametrize(
    "available, budget",
    [([10, 1000, 1000], 300), ([100, 100, 100], 1000), ([0, 50, 7, 400, 400], 301), ([5], 3), ([3, 3], 5)],
)
def test_equal_shares_match_the_definition(available, budget):
    quota = equal_shares(available, budget)
    assert quota == reference_shares(available, budget)
    assert sum(quota) == min(budget, sum(available)) and all(0 <= q <= a for q, a in zip(quota, available, strict=True))


def test_random_budgets_against_the_definition():
    rng = np.random.default_rng(0)
    for _ in range(200):
        available = rng.integers(0, 60, rng.integers(1, 7)).tolist()
        budget = int(rng.integers(0, 200))
        assert equal_shares(available, budget) == reference_shares(available, budget)


def test_a_budget_smaller_than_the_corpus_reaches_every_domain():
    # domains arrive one after another, as from a folder per domain: document order would fill the budget with "a"
    docs = [(0, np.arange(50))] * 20 + [(1, np.arange(30))] * 20 + [(2, np.arange(8))] * 2
    chosen, samples = budget_documents(iter(docs), ["a", "b", "c"], max_tokens=300)
    per_domain = [sum(len(t) for d, t in chosen if d == k) for k in range(3)]
    assert per_domain == [142, 142, 16] and sum(per_domain) == 300
    assert [s.documents for s in samples] == [3, 5, 2]  # the last document of each domain cut at its share
    assert [s.under_sampled for s in samples] == [False, False, True]
    everything, _ = budget_documents(iter(docs), ["a", "b", "c"], max_tokens=None)
    assert len(everything) == len(docs)


def test_a_document_budget_is_shared_too():
    docs = [(0, np.arange(5))] * 10 + [(1, np.arange(3))] * 10 + [(2, np.arange(2))]
    chosen, samples = budget_document_count(docs, 3, max_documents=9)
    assert [d for d, _ in chosen].count(0) == 4 and [d for d, _ in chosen].count(1) == 4
    assert [s.documents for s in samples] == [4, 4, 1] and samples[2].under_sampled


def analyze(cli, *args):
    """`moe-lm analyze args...`, which must succeed."""
    proc = cli("analyze", *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_analyze_routing_with_a_budget_analyses_every_domain(tiny_run, cli, tmp_path):
    data = tmp_path / "corpus"
    for name, words in [("alpha", "stir the onions "), ("beta", "bond yield rose "), ("gamma", "galaxy ")]:
        (data / name).mkdir(parents=True)
        n_docs = 1 if name == "gamma" else 12
        for i in range(n_docs):
            (data / name / f"{i}.txt").write_text(f"{words * 20} {i}")
    out = tmp_path / "report"
    proc = analyze(cli, "--run", tiny_run, "--data", data, "--out", out, "--max-tokens", "900", "--no-init-baseline")
    m = json.loads((out / "metrics.json").read_text())
    tokens = dict(zip(m["trace"]["domains"], m["trace"]["tokens_per_domain"], strict=True))
    assert set(tokens) == {"alpha", "beta", "gamma"} and sum(tokens.values()) == 900
    assert tokens["alpha"] == tokens["beta"] > tokens["gamma"] > 0  # gamma has less than its share of 300
    assert m["trace"]["documents_per_domain"][m["trace"]["domains"].index("gamma")] == 1
    assert m["trace"]["sampling"]["gamma"]["under_sampled"] and not m["trace"]["sampling"]["alpha"]["under_sampled"]
    assert "warning: domain 'gamma' is under-sampled" in proc.stderr
    assert f"alpha: {tokens['alpha']:,} tokens in" in proc.stdout
    assert "under-sampled" in (out / "routing.html").read_text()


def test_the_validation_split_under_a_budget_covers_every_domain(tiny_run, cli, tmp_path):
    out = tmp_path / "report"
    analyze(cli, "--run", tiny_run, "--out", out, "--max-tokens", "240", "--no-init-baseline")
    m = json.loads((out / "metrics.json").read_text())
    assert m["trace"]["tokens_per_domain"] == [80, 80, 80]
