"""What an experiment can measure, each in one registry:

    METRICS   what a comparison may name (`metric: ...`): how it is read off a run's final evaluation (its
              per-document arrays, final_eval.npz, and its result, final_eval.json), its unit, whether it has
              per-document values (then its interval also resamples documents), and the measure that records it
    MEASURES  what the final evaluation records beyond the loss (`measures: [...]`), and how a final_eval.json shows
              that it holds it (a run evaluated without it is evaluated again)
    PROBES    experiments that measure another experiment's runs (`probe: rank`): the function that does it

A new metric is one `register_metric` (its measure registered first); spec.py checks a definition against these,
arm_data.py reads metrics through them, the runner asks MEASURES whether a run is evaluated, the report prints units.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moe_lm.routing import stats


@dataclass(frozen=True)
class Measure:
    name: str
    recorded: Callable[[dict], bool]  # whether a final_eval.json holds it
    about: str


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    read: Callable[[dict, dict, np.ndarray], float]  # (final_eval.npz arrays, final_eval.json, documents) -> value
    per_document: bool  # False: measured per run only (no document bootstrap)
    measure: str | None  # the measure that records it (None: the loss, always recorded)
    about: str


MEASURES: dict[str, Measure] = {}
METRICS: dict[str, Metric] = {}
PROBES: dict[str, str] = {}  # probe -> "module:function" (imported when run: probes sit above the runner)


def register_measure(measure: Measure) -> None:
    MEASURES[measure.name] = measure


def register_metric(metric: Metric) -> None:
    if metric.measure is not None and metric.measure not in MEASURES:
        raise ValueError(f"metric {metric.name}: no measure {metric.measure!r} is registered")
    METRICS[metric.name] = metric


def register_probe(name: str, function: str) -> None:
    PROBES[name] = function


def probe_function(name: str) -> Callable:
    module, function = PROBES[name].split(":")
    return getattr(importlib.import_module(module), function)


def domain_jsd_of_documents(counts_NE: np.ndarray, doc_domain: np.ndarray, n_domains: int) -> float:
    """The mean pairwise domain JSD (bits) from per-document expert counts [N docs, E] and each document's domain."""
    per_domain = np.zeros((n_domains, counts_NE.shape[1]))
    np.add.at(per_domain, doc_domain, counts_NE)
    return stats.mean_domain_jsd(per_domain)


def _loss(a: dict, result: dict, docs: np.ndarray) -> float:
    return float(a["nll"][docs].sum() / max(a["count"][docs].sum(), 1))


def _maxvio(a: dict, result: dict, docs: np.ndarray) -> float:
    counts = a["expert_counts"][docs]  # [docs, layers, E]
    return float(np.mean([stats.max_vio(counts[:, j].sum(0)) for j in range(counts.shape[1])]))


def _domain_jsd(a: dict, result: dict, docs: np.ndarray) -> float:
    counts, n_domains = a["expert_counts"][docs], int(a["domain"].max()) + 1
    return float(
        np.mean([domain_jsd_of_documents(counts[:, j], a["domain"][docs], n_domains) for j in range(counts.shape[1])])
    )


def _jsd_over_shuffled(a: dict, result: dict, docs: np.ndarray) -> float:
    layers = result["routing"].values()  # the shuffled baseline needs every token: per run only
    return float(np.mean([v["domain_jsd"] - v["domain_jsd_shuffled"] for v in layers]))


def _erank(a: dict, result: dict, docs: np.ndarray) -> float:
    return float(np.mean(result["attention_rank"]["erank"]))  # on fixed windows, not per document


register_measure(Measure(
    "routing",
    lambda result: bool(result.get("routing")) and all("domain_jsd_init" in v for v in result["routing"].values()),
    "token-slots per MoE layer and expert per document; MaxVio_global, domain JSD with its N1 and N2 baselines",
))  # fmt: skip
register_measure(Measure(
    "attention_rank", lambda result: "attention_rank" in result,
    "the effective rank of every layer's attention matrices on fixed validation windows, trained and at init",
))  # fmt: skip
register_metric(Metric("loss", "nats/token", _loss, True, None, "the validation loss on the scored labels"))
register_metric(Metric("maxvio_global", "", _maxvio, True, "routing", "MaxVio over the whole split, mean over layers"))
register_metric(Metric("domain_jsd", "bits", _domain_jsd, True, "routing",
                       "mean pairwise JSD of the domains' expert distributions, mean over layers"))  # fmt: skip
register_metric(Metric("jsd_over_shuffled", "bits", _jsd_over_shuffled, False, "routing",
                       "domain JSD beyond its token-shuffled baseline N2 (beyond token identity)"))  # fmt: skip
register_metric(Metric("erank", "", _erank, False, "attention_rank",
                       "effective rank of the attention matrices, mean over layers"))  # fmt: skip
register_probe("rank", "moe_lm.experiments.rank_probe:run_rank_probe")
