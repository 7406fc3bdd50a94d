"""One arm of an experiment: its runs in seed order with their per-document arrays (final_eval.npz), and the
metrics a comparison reads off them, for all documents or a resampled set."""

from __future__ import annotations

import numpy as np

from moe_lm.analysis import metrics
from moe_lm.experiments.final_eval import ARRAYS, domain_jsd_of
from moe_lm.experiments.runner import Run

PER_RUN = ("jsd_over_shuffled", "erank")  # metrics without per-document values: no document bootstrap


class ArmData:
    """One arm's runs (in seed order) with their per-document arrays."""

    def __init__(self, runs: list[Run]) -> None:
        self.runs = sorted(runs, key=lambda r: r.seed)
        self.arrays = [dict(np.load(r.folder / ARRAYS)) for r in self.runs]

    def metric(self, name: str, s: int, docs: np.ndarray | None = None) -> float:
        a = self.arrays[s]
        docs = np.arange(len(a["nll"])) if docs is None else docs
        if name == "loss":
            return float(a["nll"][docs].sum() / max(a["count"][docs].sum(), 1))
        if name == "erank":  # per run only: measured on fixed windows, not per document
            return float(np.mean(self.runs[s].result["attention_rank"]["erank"]))
        counts = a["expert_counts"][docs]  # [docs, layers, E]
        if name == "maxvio_global":
            return float(np.mean([metrics.max_vio(counts[:, j].sum(0)) for j in range(counts.shape[1])]))
        n_domains = int(a["domain"].max()) + 1
        if name == "domain_jsd":
            return float(
                np.mean([domain_jsd_of(counts[:, j], a["domain"][docs], n_domains) for j in range(counts.shape[1])])
            )
        if name == "jsd_over_shuffled":  # per run only: the shuffled baseline needs every token
            layers = self.runs[s].result["routing"].values()
            return float(np.mean([v["domain_jsd"] - v["domain_jsd_shuffled"] for v in layers]))
        raise ValueError(f"unknown metric {name!r}")
