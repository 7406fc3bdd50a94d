"""The measures' registry (moe_lm/experiments/measures.py): each metric is read the same way for every document or a
resampled set, is recorded by a registered measure, and a new metric is one entry that a definition may then name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from moe_lm.config import ConfigError
from moe_lm.experiments import measures
from moe_lm.experiments.measures import MEASURES, METRICS, Metric, domain_jsd_of_documents
from moe_lm.experiments.spec import load_experiment
from moe_lm.routing import stats

PRESETS = Path(measures.__file__).resolve().parents[1] / "configs"


def arrays(rng, docs=6, layers=2, experts=4):
    return {"nll": rng.random(docs) * 10, "count": rng.integers(1, 9, docs).astype(float),
            "expert_counts": rng.integers(0, 20, (docs, layers, experts)), "domain": np.arange(docs) % 3}  # fmt: skip


def test_each_metric_reads_its_definition():
    a = arrays(np.random.default_rng(0))
    docs = np.array([0, 2, 3, 5])
    assert METRICS["loss"].read(a, {}, docs) == pytest.approx(a["nll"][docs].sum() / a["count"][docs].sum())
    counts = a["expert_counts"][docs]
    assert METRICS["maxvio_global"].read(a, {}, docs) == pytest.approx(
        np.mean([stats.max_vio(counts[:, j].sum(0)) for j in range(2)])
    )
    per_domain = [np.array([counts[(a["domain"][docs] == d), j].sum(0) for d in range(3)]) for j in range(2)]
    assert METRICS["domain_jsd"].read(a, {}, docs) == pytest.approx(
        np.mean([stats.mean_pairwise(stats.domain_jsd_table(p)) for p in per_domain])
    )
    assert domain_jsd_of_documents(counts[:, 0], a["domain"][docs], 3) == pytest.approx(
        stats.mean_pairwise(stats.domain_jsd_table(per_domain[0]))
    )
    result = {
        "routing": {"layer_1": {"domain_jsd": 0.3, "domain_jsd_shuffled": 0.1}},
        "attention_rank": {"erank": [2, 4]},
    }
    assert METRICS["jsd_over_shuffled"].read(a, result, docs) == pytest.approx(0.2)
    assert METRICS["erank"].read(a, result, docs) == 3.0
    assert all(m.measure is None or m.measure in MEASURES for m in METRICS.values())


def test_a_new_metric_is_one_entry_a_definition_may_name(tmp_path, monkeypatch):
    monkeypatch.setitem(METRICS, "loss_per_label", Metric("loss_per_label", "nats", lambda a, r, d: 0.0, True, None,
                                                          "a metric added in one entry"))  # fmt: skip
    spec = {"claim": "c", "source": "s", "config": str(PRESETS / "tiny.yaml"), "arms": {"x": [], "y": []},
            "comparisons": [{"a": "x", "b": "y", "metric": "loss_per_label", "expect": "lower"}]}  # fmt: skip
    (tmp_path / "e.yaml").write_text(yaml.safe_dump(spec))
    assert load_experiment(str(tmp_path / "e.yaml")).comparisons[0].metric == "loss_per_label"
    monkeypatch.delitem(METRICS, "loss_per_label")
    with pytest.raises(ConfigError, match="metric must be one of"):
        load_experiment(str(tmp_path / "e.yaml"))
    spec["comparisons"][0]["metric"], spec["probe"] = "loss", "nowhere"
    (tmp_path / "e.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match="unknown probe 'nowhere'"):
        load_experiment(str(tmp_path / "e.yaml"))
    assert callable(measures.probe_function("rank"))
