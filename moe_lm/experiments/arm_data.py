"""One arm of an experiment: its runs in seed order with their per-document arrays (final_eval.npz) and step rows
(metrics.jsonl), and the metrics a comparison reads off them, for all documents or a resampled set."""

from __future__ import annotations

import numpy as np

from moe_lm.experiments.curves import rows
from moe_lm.experiments.final_eval import ARRAYS
from moe_lm.experiments.measures import METRICS
from moe_lm.experiments.runner import Run


class ArmData:
    """One arm's runs (in seed order) with their per-document arrays."""

    def __init__(self, runs: list[Run]) -> None:
        self.runs = sorted(runs, key=lambda r: r.seed)
        self.arrays = [dict(np.load(r.folder / ARRAYS)) for r in self.runs]

    def metric(self, name: str, s: int, docs: np.ndarray | None = None) -> float:
        """Metric `name` (measures.METRICS) of the arm's run `s`, over `docs` (default: every document)."""
        a = self.arrays[s]
        docs = np.arange(len(a["nll"])) if docs is None else docs
        return METRICS[name].read(a, self.runs[s].result, docs)

    def step_rows(self, s: int, kind: str) -> list[dict]:
        """The `kind` rows ("train", "eval") of run `s`'s metrics.jsonl."""
        return rows(self.runs[s].folder, kind)
