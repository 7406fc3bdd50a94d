"""Pipeline stages on paper: which layers each stage holds, their parameters, and the 1F1B schedule's cost.

The pipeline's layers and DeepSpeed's cut of them are moe_lm/deepspeed_layout.py's (the runtime builds each stage
from the same cut), so the planner's stages are the engine's (tested against the stages a run reports).

Under 1F1B (DeepSpeed's TrainSchedule) stage s of pp starts min(pp - s, m) micro-batches before its first backward
and then alternates one forward and one backward: it keeps the activations of that many micro-batches at its peak
(the first stage the most). The idle share of a step, the bubble, is (pp - 1) / (m + pp - 1) for m micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_lm.config import Config
from moe_lm.deepspeed_layout import layer_params, partition


@dataclass
class Stage:
    """What one stage holds: its pipeline layers [start, stop), parameters (routed experts apart, counted whole,
    before the split over ep_size), the decoder and MTP blocks whose activations it keeps (MoE or dense), whether
    it computes the output heads, and the micro-batches in flight at its peak."""

    start: int
    stop: int
    other_params: float
    expert_params: float
    blocks: list[bool]  # per block: MoE (True) or dense
    head: bool
    in_flight: int


def stages(cfg: Config) -> list[Stage]:
    """The stages of cfg.parallel.pp_size (one stage holding everything without pipeline parallelism)."""
    layers, pp, m = layer_params(cfg), cfg.parallel.pp_size, cfg.train.grad_accum_steps
    bounds = partition(cfg) if pp > 1 else [0, len(layers)]
    out = []
    for s in range(pp):
        held = layers[bounds[s] : bounds[s + 1]]
        other = sum(x[0] for x in held)
        if cfg.model.mtp.depth and bounds[s] == 0 and bounds[s + 1] == len(layers):
            other -= layers[0][0]  # both uses of the tied embedding on one stage: one module
        out.append(
            Stage(
                bounds[s], bounds[s + 1], other, sum(x[1] for x in held), [b for x in held for b in x[2]],
                any(x[3] for x in held), min(pp - s, m),
            )
        )  # fmt: skip
    return out


def bubble(pp: int, micro_batches: int) -> float:
    """The idle share of a 1F1B step: (pp - 1) / (m + pp - 1)."""
    return (pp - 1) / (micro_batches + pp - 1)
