"""Pipeline stages on paper: which layers each stage holds, their parameters, and the 1F1B schedule's cost.

The pipeline's layers are moe_lm/parallel/pipeline.py's: the embedding, the n decoder blocks, the head (final
norm, output head, MTP modules) and, with MTP, the embedding again (tied). DeepSpeed cuts them by parameter count
(`partition_method="parameters"`: each layer's trainable parameters as the rank holds them, routed experts already
split over ep_size) with its own `partition_balanced`; so does this module, so the planner's stages are the
engine's (tested against the stages a run reports).

Under 1F1B (DeepSpeed's TrainSchedule) stage s of pp starts min(pp - s, m) micro-batches before its first backward
and then alternates one forward and one backward: it keeps the activations of that many micro-batches at its peak
(the first stage the most). The idle share of a step, the bubble, is (pp - 1) / (m + pp - 1) for m micro-batches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moe_lm.config import Config
from moe_lm.model.params import stack_params


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


def layer_params(cfg: Config) -> list[tuple[float, float, list[bool], bool]]:
    """Per pipeline layer: (parameters outside routed experts, routed experts' parameters, blocks, is the head)."""
    m = cfg.model
    D, e = m.dim, m.moe
    expert = 3 * D * e.moe_inter_dim
    embed = m.vocab_size * D
    layers: list[tuple[float, float, list[bool], bool]] = [(embed, 0, [], False)]
    for i in range(m.n_layers):
        moe = i >= m.first_k_dense_replace
        block = stack_params(dataclasses.replace(m, first_k_dense_replace=0 if moe else 1), 1)
        experts = e.n_routed_experts * expert if moe else 0
        layers.append((block - experts, experts, [moe], False))
    mtp_cfg = dataclasses.replace(m, first_k_dense_replace=0)
    module = 3 * D + 2 * D * D + stack_params(mtp_cfg, 1)  # enorm, hnorm, head norm, eh_proj, one MoE block
    mtp_experts = m.mtp.depth * e.n_routed_experts * expert
    head = D + embed + m.mtp.depth * module  # final norm, output head, MTP modules
    layers.append((head - mtp_experts, mtp_experts, [True] * m.mtp.depth, True))
    if m.mtp.depth:
        layers.append((embed, 0, [], False))  # the tied embedding the MTP modules read
    return layers


def partition(cfg: Config) -> list[int]:
    """The stages' layer bounds [0, b_1, ..., n]: DeepSpeed's cut over each layer's parameters as a rank holds them
    (its share of the routed experts)."""
    ep = cfg.parallel.ep_size
    return balanced_bounds(
        [int(other + experts / ep) for other, experts, _, _ in layer_params(cfg)], cfg.parallel.pp_size
    )


def balanced_bounds(weights: list[int], parts: int) -> list[int]:
    """DeepSpeed's `partition_balanced` (runtime/utils.py), which PipelineModule(partition_method="parameters")
    calls: of the cuts of `weights` into `parts` consecutive runs, the one whose heaviest and lightest runs differ
    least (its dynamic programme, ties to the latest cut; tested equal to DeepSpeed's). With no more layers than
    parts, one layer a stage (DeepSpeed's partition_uniform). why our own: the planner stays free of DeepSpeed."""
    n = len(weights)
    if n <= parts:
        return [min(p, n) for p in range(parts + 1)]
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[i][j]: (cost = heaviest - lightest, heaviest, lightest, where the last run starts) for the first i
    # layers in j runs
    best = [[(inf, inf, inf, 0)] * (parts + 1) for _ in range(n + 1)]
    best[0][0] = (0, 0, inf, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, parts) + 1):
            for k in range(i):
                _, heavy, light, _ = best[k][j - 1]
                run = prefix[i] - prefix[k]
                heaviest, lightest = max(heavy, run), min(light, run)
                if best[i][j][0] >= heaviest - lightest:
                    best[i][j] = (heaviest - lightest, heaviest, lightest, k)
    bounds = [n]
    for j in range(parts, 0, -1):
        bounds.append(best[bounds[-1]][j][3])
    return bounds[::-1]


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


def describe_layer(cfg: Config, index: int) -> str:
    """A pipeline layer's name, as the stage table prints it."""
    n = cfg.model.n_layers
    if index == 0:
        return "embedding"
    if index <= n:
        return f"block {index - 1}"
    return "head" if index == n + 1 else "embedding (tied)"


def describe_stages(cfg: Config, bounds: list[int]) -> str:
    """'stage 0: embedding .. block 2; stage 1: block 3 .. head' for the layer bounds [0, b_1, ..., n]. With
    DualPipeV (2 x pp_size slices), per rank: its slice r and the mirrored slice 2 pp_size - 1 - r."""

    def span(s: int) -> str:
        return f"{describe_layer(cfg, bounds[s])} .. {describe_layer(cfg, bounds[s + 1] - 1)}"

    slices = len(bounds) - 1
    if cfg.parallel.pp_schedule == "dualpipev":
        return "; ".join(f"rank {r}: {span(r)} + {span(slices - 1 - r)}" for r in range(slices // 2))
    return "; ".join(f"stage {s}: {span(s)}" for s in range(slices))
