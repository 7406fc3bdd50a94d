"""Which routed experts a pruned model keeps: the caller's `keep` checked against the source's MoE layers and expert
counts, and the renumbering it implies. The one place every pruned format (hf_folder.py, fp8_release.py,
gguf_file.py) takes its rule from.

`keep` maps each MoE layer (the N of `model.layers.N` / `blk.N`, MTP layers included where the source has them) to the
ascending ids of the routed experts it keeps. A model has one n_routed_experts, so every MoE layer keeps the same
number E'; the kept ones become experts 0..E'-1 in ascending order.

Why a pruned model is the source with the pruned experts' selection bias at -inf: the bias (e_score_correction_bias,
llama.cpp's exp_probs_b) only chooses the experts; the gate weights are the unbiased sigmoid scores of the chosen
ones. So removing experts is masking their scores before every choice, the groups' included. With expert groups
(n_group > 1), the groups are contiguous id ranges: renumbered in ascending order the kept experts stay in their
groups when every group keeps the same number. A group's score is the sum of its two best biased scores (DeepSeek-V3's
`noaux_tc`, transformers' DeepseekV3TopkRouter and Glm4MoeTopkRouter, llama.cpp's build_moe_ffn alike), so each group
must keep at least two for the masked source to give the same group scores as the pruned model (and transformers
takes the top 2 of each group, which a group of one cannot give).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from moe_lm.errors import UserError, shown


@dataclass(frozen=True)
class KeptExperts:
    """The checked `keep`: `ids[layer]` the source ids each MoE layer keeps (ascending), `n_experts` the source's
    count; the kept expert `ids[layer][j]` is expert j of the pruned model."""

    ids: dict[int, tuple[int, ...]]
    n_experts: int

    @property
    def count(self) -> int:
        """E': the routed experts of every MoE layer of the pruned model."""
        return len(next(iter(self.ids.values())))

    def new_id(self, layer: int, old: int) -> int | None:
        """The pruned model's id of source expert `old` of `layer` (None: pruned)."""
        kept = self.ids[layer]
        j = bisect.bisect_left(kept, old)
        return j if j < len(kept) and kept[j] == old else None


def checked_keep(
    keep: Mapping[int, Sequence[int]],
    layers: Sequence[int],
    n_experts: int,
    top_k: int,
    n_group: int,
    topk_group: int,
    where: Path,
) -> KeptExperts:
    """`keep` as KeptExperts, checked against the source's MoE `layers`, its `n_experts` routed experts, `top_k` chosen
    per token and its expert groups; a one-line UserError naming `where` (the file the counts come from) otherwise."""

    def refuse(why: str) -> UserError:
        return UserError(f"{where}: keep {why}")

    if not isinstance(keep, Mapping):
        raise refuse(f"is {type(keep).__name__}, not a mapping {{MoE layer: ascending expert ids}}")
    layers = sorted(layers)
    if bad := [k for k in keep if type(k) is not int]:
        raise refuse(f"has the key {shown(bad[0])}; its keys are MoE layer numbers (the N of model.layers.N / blk.N)")
    if extra := sorted(set(keep) - set(layers)):
        raise refuse(f"names layer(s) {shown(extra)}, which are not MoE layers of this model (they are "
                     f"{shown(layers)})")  # fmt: skip
    if missing := [layer for layer in layers if layer not in keep]:
        raise refuse(f"names no experts for MoE layer(s) {shown(missing)}; every MoE layer keeps the same number of "
                     f"experts (the model has one n_routed_experts), so name them all: {shown(layers)}")  # fmt: skip
    ids: dict[int, tuple[int, ...]] = {}
    for layer in layers:
        kept = keep[layer]
        if isinstance(kept, (str, bytes)) or not isinstance(kept, Sequence):
            raise refuse(f"[{layer}] is {shown(kept)}, not a sequence of expert ids")
        if bad := [e for e in kept if type(e) is not int or not 0 <= e < n_experts]:
            raise refuse(f"[{layer}] holds {shown(bad[0])}, which is not an expert id (0 to {n_experts - 1})")
        if any(b <= a for a, b in zip(kept, kept[1:], strict=False)):
            raise refuse(f"[{layer}] is {shown(list(kept))}: expert ids must be ascending, each once")
        ids[layer] = tuple(kept)
    counts = {layer: len(kept) for layer, kept in ids.items()}
    if len(set(counts.values())) > 1:
        raise refuse(f"keeps {shown(counts)} experts by layer; every MoE layer must keep the same number (the model "
                     "has one n_routed_experts)")  # fmt: skip
    count = next(iter(counts.values()), 0)
    if count < max(top_k, 1):
        raise refuse(f"keeps {count} experts a layer, fewer than the {top_k} each token chooses (num_experts_per_tok)")
    if n_group > 1:
        size = n_experts // n_group
        for layer, kept in ids.items():
            per_group = [sum(1 for e in kept if e // size == g) for g in range(n_group)]
            if len(set(per_group)) > 1 or per_group[0] < 2:
                raise refuse(
                    f"[{layer}] keeps {per_group} experts in its {n_group} groups of {size}; with expert groups every "
                    "group must keep the same number, at least 2 (a group's score is the sum of its two best "
                    "experts'), so that the kept experts stay grouped"
                )
        if topk_group * (count // n_group) < top_k:
            raise refuse(f"keeps {count // n_group} experts a group: {topk_group} groups (topk_group) then hold fewer "
                         f"than the {top_k} experts each token chooses")  # fmt: skip
    return KeptExperts(ids, n_experts)
