"""Which routed experts each MoE layer keeps (`KeepPlan`), and how many it may keep (`keep_count`).

A config has one `n_routed_experts`, so every MoE layer keeps the same number. Under group-limited routing the E
experts form n_group contiguous groups of E / n_group ids, and a token's experts come from its topk_group best groups,
each scored by the sum of its top-2 biased scores. So every group keeps the same number m, and the kept ids stay in
ascending order: group g's kept experts are then the contiguous ids [g m, (g + 1) m) of the pruned layer, n_group and
topk_group unchanged (E' = n_group m). That needs m >= 2 when n_group > 1 (a group of one has no top-2 to score it)
and m topk_group >= k (a token must find k experts in its best groups). Shared experts are never pruned.

Where the groups cannot stay equal (8 experts in 4 groups of 2 keep none but all of them), `--ungroup` drops them:
the plan ranks each layer's experts as one group and the pruned model routes without group limitation (n_group 1,
topk_group 1); what that alone changes is measured beside the pruned arms (check.py).

A plan is written beside the pruned model as prune.json (`to_json` / `from_json`): the criterion, the sparsity, the
domains it was measured on, the source, and per layer the kept ids and every expert's score.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moe_lm.errors import DataError, UserError

PLAN_FILE = "prune.json"


@dataclass(frozen=True)
class RoutingShape:
    """What of the routing constrains a plan: E routed experts, n_group groups, topk_group kept, k per token."""

    n_experts: int
    n_group: int
    topk_group: int
    k: int

    def ungrouped(self) -> RoutingShape:
        """The routing of a pruned model that drops the expert groups (`--ungroup`): one group, all of it used."""
        return RoutingShape(self.n_experts, 1, 1, self.k)

    def valid_keep(self, n_keep: int) -> bool:
        """Whether keeping `n_keep` experts of each layer leaves group-limited top-k routing valid (and removes one)."""
        if not self.k <= n_keep < self.n_experts or n_keep % self.n_group:
            return False
        m = n_keep // self.n_group
        return (self.n_group == 1 or m >= 2) and m * self.topk_group >= self.k


def keep_count(shape: RoutingShape, sparsity: float | None = None, keep: int | None = None) -> int:
    """The experts each layer keeps for `--sparsity F` (a fraction of each layer's routed experts removed, rounded to
    the nearest count) or `--keep N`; a UserError in one line, with the nearest valid counts, when the routing
    cannot stay valid."""
    E, G = shape.n_experts, shape.n_group
    if sparsity is not None:
        if not 0 < sparsity < 1:
            raise UserError(f"--sparsity must be a fraction between 0 and 1 (exclusive) of each layer's {E} routed "
                            f"experts, got {sparsity:g}")  # fmt: skip
        n_keep, asked = E - round(sparsity * E), f"--sparsity {sparsity:g} keeps {E - round(sparsity * E)} of {E}"
    else:
        n_keep, asked = int(keep), f"--keep {keep} of {E}"
    if n_keep >= E:
        raise UserError(f"{asked} routed experts: that removes none; give a sparsity above 0 or fewer to keep")
    if n_keep < shape.k:
        raise UserError(f"{asked} routed experts: fewer than the {shape.k} each token is routed to "
                        f"(num_experts_per_tok){_nearest(shape, n_keep)}")  # fmt: skip
    m = n_keep // G
    if n_keep % G:
        why = f"which the {G} expert groups cannot share equally (group-limited routing needs the same in each)"
    elif G > 1 and m < 2:
        why = f"{m} per group, and a group's score is the sum of its top-2 experts"
    elif m * shape.topk_group < shape.k:
        why = f"{m} per group, and the topk_group={shape.topk_group} best groups must hold the {shape.k} chosen"
    else:
        return n_keep
    ungroup = ""
    if shape.n_group > 1 and shape.ungrouped().valid_keep(n_keep):
        ungroup = f"; or keep {n_keep} with --ungroup (the pruned model then routes without expert groups)"
    raise UserError(f"{asked} routed experts, {why}{_nearest(shape, n_keep)}{ungroup}")


def _nearest(shape: RoutingShape, n_keep: int) -> str:
    valid = [n for n in range(1, shape.n_experts) if shape.valid_keep(n)]
    if not valid:
        return f"; no count can be pruned to at {shape.n_experts} experts in {shape.n_group} groups (top-{shape.k})"
    below, above = [n for n in valid if n < n_keep][-1:], [n for n in valid if n > n_keep][:1]
    options = " or ".join(f"--keep {n} (sparsity {1 - n / shape.n_experts:.4g})" for n in below + above)
    return f"; the nearest valid: {options}"


@dataclass(frozen=True)
class KeepPlan:
    """Per MoE layer id (the model's numbering, as `Transformer.moe_layer_ids()` and `Trace.layers` have it) the
    routed experts kept, ascending, the same count in every layer and every group; with each expert's score and how
    the plan was made (`about`: criterion, sparsity, domains, source)."""

    n_experts: int  # E before pruning
    n_group: int
    kept: dict[int, tuple[int, ...]]
    scores: dict[int, tuple[float, ...]] = field(default_factory=dict)
    about: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        counts = {len(ids) for ids in self.kept.values()}
        if len(counts) != 1:
            raise ValueError(f"every layer must keep the same number of experts, got {sorted(counts)}")
        size, m = self.n_experts // self.n_group, self.n_keep // self.n_group
        for layer, ids in self.kept.items():
            groups = np.bincount(np.asarray(ids) // size, minlength=self.n_group)
            if list(ids) != sorted(set(ids)) or ids[-1] >= self.n_experts or (groups != m).any():
                raise ValueError(f"layer {layer} keeps {list(ids)}: not ascending ids, {m} in each group of {size}")

    @property
    def n_keep(self) -> int:
        return len(next(iter(self.kept.values())))

    @property
    def layers(self) -> list[int]:
        return sorted(self.kept)

    def removed(self, layer: int) -> list[int]:
        """The experts layer `layer` loses."""
        return sorted(set(range(self.n_experts)) - set(self.kept[layer]))

    def with_untraced(self, layers: list[int]) -> KeepPlan:
        """The plan over `layers`, the MoE layers the written model holds: each one it has no scores for (a
        multi-token-prediction / NextN layer after the decoder, which no calibration token routes through) keeps the
        ids of the last scored layer, said in `about["untraced"]`; a ValueError for one before the last scored."""
        untraced = [layer for layer in layers if layer not in self.kept]
        if not untraced:
            return self
        last = self.layers[-1]
        if untraced[0] < last:
            raise ValueError(f"layer {untraced[0]} has no scores and comes before the scored layer {last}")
        kept = {**self.kept, **dict.fromkeys(untraced, self.kept[last])}
        about = {**self.about, "untraced": {str(layer): last for layer in untraced}}
        return KeepPlan(self.n_experts, self.n_group, kept, dict(self.scores), about)

    @classmethod
    def from_scores(cls, scores: dict[int, np.ndarray], n_keep: int, n_group: int, about: dict | None = None):
        """In every layer, each group's n_keep / n_group highest-scoring experts (a tie to the lower id).
        `scores`: per MoE layer id, [E] (higher: more worth keeping)."""
        E = len(next(iter(scores.values())))
        size, m = E // n_group, n_keep // n_group
        kept = {}
        for layer, s in scores.items():
            s = np.nan_to_num(np.asarray(s, np.float64), nan=-np.inf)
            ids = []
            for g in range(n_group):
                group = np.arange(g * size, (g + 1) * size)
                order = np.lexsort((group, -s[group]))  # why lexsort: highest score first, ties to the lower id
                ids += group[order[:m]].tolist()
            kept[layer] = tuple(sorted(ids))
        as_floats = {layer: tuple(float(v) for v in s) for layer, s in scores.items()}
        return cls(E, n_group, kept, as_floats, dict(about or {}))

    def to_json(self) -> dict:
        return {
            "n_experts": self.n_experts, "n_keep": self.n_keep, "n_group": self.n_group, **self.about,
            "layers": {str(layer): {"kept": list(self.kept[layer]), "scores": list(self.scores.get(layer, ()))}
                       for layer in self.layers},
        }  # fmt: skip

    @classmethod
    def from_json(cls, record: dict, where: str = PLAN_FILE) -> KeepPlan:
        """The plan `to_json` wrote; a DataError naming `where` for a record that is not one."""
        try:
            layers = record["layers"]
            kept = {int(layer): tuple(int(e) for e in v["kept"]) for layer, v in layers.items()}
            scores = {int(layer): tuple(float(s) for s in v["scores"]) for layer, v in layers.items() if v["scores"]}
            about = {k: v for k, v in record.items() if k not in ("n_experts", "n_keep", "n_group", "layers")}
            return cls(int(record["n_experts"]), int(record["n_group"]), kept, scores, about)
        except (KeyError, TypeError, ValueError, AttributeError, StopIteration) as e:
            raise DataError(f"{where} is not a pruning plan moe-lm wrote ({type(e).__name__}: {e})") from None
