"""What an experiment can measure, each in one registry:

    MEASURES  what the final evaluation records beyond the loss (`measures: [...]`): how it is recorded (its
              Recording, recording.py, started on each run's final evaluation), how a final_eval.json shows that it
              holds it (a run evaluated without it is evaluated again), its lines in the report and its figures
    METRICS   what a comparison may name (`metric: ...`): how it is read off a run's final evaluation (its
              per-document arrays, final_eval.npz, and its result, final_eval.json), its unit, whether it has
              per-document values (then its interval also resamples documents), and the measure that records it
    PROBES    experiments that measure another experiment's runs (`probe: rank`): the function that does it

A new measure is one `register_measure` here (its recording, its report lines and figures with it); a new metric is
one `register_metric` (its measure registered first). spec.py checks a definition against these, final_eval.py runs
the measures a definition names, the runner asks MEASURES whether a run is evaluated, arm_data.py reads metrics
through them, the report prints their lines, units and figures.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_lm.experiments import routing_measure
from moe_lm.experiments.attention_probe import erank_by_layer, probe_windows
from moe_lm.experiments.recording import Evaluation, Recording, of_the_model
from moe_lm.experiments.routing_measure import domain_jsd_of_documents
from moe_lm.model import initial_model
from moe_lm.routing import stats

RANK_WINDOWS = 32  # validation windows the attention-rank measure reads (as the rank experiment's probe)


def no_figures(by_arm: dict, domains: list[str], folder: Path) -> list[Path]:
    return []


@dataclass(frozen=True)
class Measure:
    name: str
    about: str
    start: Callable[[Evaluation], Recording]  # made before a run's final evaluation runs its first batch
    recorded: Callable[[dict], bool]  # whether a final_eval.json holds it
    report: Callable[[dict], list[str]]  # its lines in report.md, from each arm's runs (arm -> ArmData)
    figures: Callable[[dict, list[str], Path], list[Path]] = no_figures  # (arm -> ArmData, domains, folder) -> files


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


# ---- attention_rank: the effective rank of the attention matrices, trained and at initialisation --------------------


def attention_rank(evaluation: Evaluation) -> dict:
    """Every layer's attention erank on RANK_WINDOWS validation windows, read the way the run's objective reads them
    (an MLM's masked inputs), trained and at initialisation."""
    model, objective = evaluation.model, evaluation.objective
    probe, untrained = probe_windows(evaluation.cfg, RANK_WINDOWS), initial_model(evaluation.cfg).eval()
    return {"attention_rank": {
        "windows": len(probe),
        "erank": erank_by_layer(model, probe, forward=lambda chunk: objective.run(model, chunk)),
        "erank_init": erank_by_layer(untrained, probe, forward=lambda chunk: objective.run(untrained, chunk)),
    }}  # fmt: skip


def attention_rank_lines(by_arm: dict) -> list[str]:
    n_windows = next(iter(by_arm.values())).runs[0].result["attention_rank"]["windows"]
    lines = ["", f"Effective rank of the attention matrices (mean over heads and {n_windows} validation windows, "
             "read as in training; mean over seeds), by layer:", "", "| arm | trained | at initialisation |",
             "|---|---|---|"]  # fmt: skip
    for arm, data in by_arm.items():
        cells = [
            ", ".join(f"{v:.1f}" for v in np.mean([r.result["attention_rank"][key] for r in data.runs], 0))
            for key in ("erank", "erank_init")
        ]
        lines.append(f"| {arm} | {cells[0]} | {cells[1]} |")
    return lines


# ---- metrics ---------------------------------------------------------------------------------------------------------


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
    "routing", "token-slots per MoE layer and expert per document; MaxVio_global, domain JSD with its N1 and N2 "
    "baselines", routing_measure.RoutingRecording, routing_measure.recorded, routing_measure.routing_lines,
    routing_measure.routing_figures,
))  # fmt: skip
register_measure(Measure(
    "attention_rank", "the effective rank of every layer's attention matrices on fixed validation windows, trained "
    "and at init", of_the_model(attention_rank), lambda result: "attention_rank" in result, attention_rank_lines,
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
