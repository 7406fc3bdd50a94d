"""What a measure is given and gives in a run's final evaluation (final_eval.py runs it; measures.py registers the
measures): `Evaluation`, the run and the windows it is scored on, and `Recording`, a measure at work on them, which
sees every batch of validation windows as the model ran it and then gives its entries of final_eval.json and its
per-document arrays of final_eval.npz."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from moe_lm.config import Config
from moe_lm.data.shards import TokenShard
from moe_lm.routing.recorder import RoutingRecorder
from moe_lm.train.objective import Objective


@dataclass(frozen=True)
class Evaluation:
    """One run's final evaluation, as a measure reads it."""

    cfg: Config  # the run's config
    model: torch.nn.Module  # its final checkpoint, in eval mode
    shard: TokenShard  # the validation split
    windows: list[tuple[int, np.ndarray]]  # (document, window) of every window with a label, sorted by length
    objective: Objective  # how the run is scored: objective.run(model, batch) -> (output, labels)
    batch_size: int

    def batches(self) -> Iterator[list[tuple[int, np.ndarray]]]:
        """Consecutive runs of equal-length windows (the list is sorted by length), at most batch_size each. why
        equal lengths: batches without padding, which a bidirectional model would attend to."""
        windows, i = self.windows, 0
        while i < len(windows):
            j = i
            while j < len(windows) and j - i < self.batch_size and len(windows[j][1]) == len(windows[i][1]):
                j += 1
            yield windows[i:j]
            i = j


class Recording(ABC):
    """A measure at work on one run's final evaluation (its Measure.start makes it before the first batch)."""

    def add(self, docs: list[int], batch_BS1: torch.Tensor, recorder: RoutingRecorder) -> None:  # noqa: B027
        """One batch of validation windows as the model ran it: each window's document, its tokens [B, S + 1] and
        the routers' choices (`recorder.last`). Nothing by default: a measure of the model alone reads no batch."""

    @abstractmethod
    def finish(self) -> tuple[dict, dict[str, np.ndarray]]:
        """What the measure records: entries of final_eval.json, and per-document arrays of final_eval.npz."""


class OfTheModel(Recording):
    """A measure of the evaluated model alone, on windows of its own choosing: `measure(evaluation)` gives its
    entries of final_eval.json once the batches are done."""

    def __init__(self, measure: Callable[[Evaluation], dict], evaluation: Evaluation) -> None:
        self.measure, self.evaluation = measure, evaluation

    def finish(self) -> tuple[dict, dict[str, np.ndarray]]:
        return self.measure(self.evaluation), {}


def of_the_model(measure: Callable[[Evaluation], dict]) -> Callable[[Evaluation], Recording]:
    """A Measure's `start` for a measure of the model alone (`measure`: the evaluation -> its entries)."""
    return lambda evaluation: OfTheModel(measure, evaluation)
