"""The measures' registry (moe_lm/experiments/measures.py): each metric is read the same way for every document or a
resampled set, is recorded by a registered measure, and a new metric is one entry that a definition may then name; a
new measure is one entry too, evaluated with each run and reported."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from moe_lm.config import ConfigError, dump_config
from moe_lm.experiments import measures, runner
from moe_lm.experiments.final_eval import evaluate_run
from moe_lm.experiments.measures import MEASURES, METRICS, Measure, Metric, domain_jsd_of_documents
from moe_lm.experiments.recording import Evaluation, Recording
from moe_lm.experiments.report import write_report
from moe_lm.experiments.runner import Run
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


class LabelsSeen(Recording):
    """A toy measure: the labels each document's windows hold, counted from the batches as the model ran them."""

    def __init__(self, evaluation: Evaluation) -> None:
        self.seen = np.zeros(evaluation.shard.n_docs, dtype=np.int64)

    def add(self, docs, batch_BS1, recorder) -> None:
        for d in docs:
            self.seen[d] += batch_BS1.shape[1] - 1  # next-token windows: every position but the last is a label

    def finish(self) -> tuple[dict, dict[str, np.ndarray]]:
        return {"labels_seen": int(self.seen.sum())}, {"labels_seen": self.seen}


def labels_seen_lines(by_arm: dict) -> list[str]:
    return ["", "| arm | labels seen |", "|---|---|"] + [
        f"| {arm} | {data.runs[0].result['labels_seen']:,} |" for arm, data in by_arm.items()
    ]


def labels_seen_figure(by_arm: dict, domains: list[str], folder: Path) -> list[Path]:
    (folder / "labels_seen.png").write_bytes(b"")
    return [folder / "labels_seen.png"]


def test_a_new_measure_is_one_registration_evaluated_and_reported(copied_run, tmp_path, monkeypatch):
    """A measure registered from outside (docs/experiments.md, "Adding a measure"): a definition may name it, a run's
    final evaluation records it on its own batches (per document, beside the loss's label counts, which it must
    equal), a run evaluated without it is evaluated again, and the report prints its lines and its figure."""
    monkeypatch.setitem(MEASURES, "labels_seen", Measure("labels_seen", "labels per document", LabelsSeen,
                        lambda result: "labels_seen" in result, labels_seen_lines, labels_seen_figure))  # fmt: skip
    cfg = copied_run()
    dump_config(cfg, tmp_path / "base.yaml")
    spec = {"claim": "c", "source": "s", "config": str(tmp_path / "base.yaml"), "steps": cfg.train.max_steps,
            "seeds": 1, "measures": ["labels_seen"], "arms": {"a": [], "b": []}, "comparisons": []}  # fmt: skip
    (tmp_path / "e.yaml").write_text(yaml.safe_dump(spec))
    exp = load_experiment(str(tmp_path / "e.yaml"))
    folder = tmp_path / "run"
    result = evaluate_run(folder, measures=())
    runs = [Run(arm, 0, cfg, folder, result) for arm in exp.arms]
    assert "labels_seen" not in result and not runner.is_done(runs[0], exp)
    result = evaluate_run(folder, measures=tuple(exp.measures))
    arrays = np.load(folder / "final_eval.npz")
    assert result["labels_seen"] == result["labels"] and np.array_equal(arrays["labels_seen"], arrays["count"])
    assert runner.is_done(runs[0], exp)
    runs = [Run(arm, 0, cfg, folder, result) for arm in exp.arms]
    write_report(exp, runs, tmp_path / "report", n_boot=10)
    report = (tmp_path / "report" / "report.md").read_text()
    assert f"| a | {result['labels']:,} |" in report and "figures/labels_seen.png" in report
