"""Do routing statistics measured before pruning predict what a prune costs a domain? From a `moe-lm prune --check`
folder (check.json and the calibration trace it recorded): for every arm (criterion x sparsity; random per seed) and
domain, the share of the domain's calibration load and of its REAP saliency mass that falls on the experts the arm
removes (mean over MoE layers), against the arm's held-out Δ log-prob per token for that domain; Spearman's ρ over
all (arm, domain) pairs, and the same per sparsity. First, per layer, how concentrated the saliency is and how much
the domains' experts overlap, and whether a domain's overlap orders its cost.

    python docs/results/prune/predictors.py CHECK_FOLDER > predictors.md
"""

import json
import sys
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from moe_lm.analysis.metrics import reap_saliency
from moe_lm.pruning.plan import KeepPlan
from moe_lm.routing.trace import Trace


def domain_masses(trace: Trace) -> tuple[dict, dict]:
    """Per MoE layer, [D, E] token-slots and saliency mass (sum of gate x norm) of each domain's calibration tokens."""
    D, E = len(trace.domains), trace.n_experts
    load, mass = {}, {}
    for layer in trace.layers:
        experts, weights, norms = (np.asarray(c) for c in (trace.experts(layer), trace.weights(layer),
                                                           trace.norms(layer)))  # fmt: skip
        counts = np.zeros((D, E))
        np.add.at(counts, (np.repeat(np.asarray(trace.domain), trace.k), experts.ravel()), 1.0)
        load[layer] = counts
        mass[layer] = reap_saliency(experts, weights, norms, E, trace.domain, D) * counts  # mean x count = sum
    return load, mass


def removed_share(per_layer: dict, plan: KeepPlan, d: int) -> float:
    """The domain's share of `per_layer` [D, E] on the plan's removed experts, mean over layers."""
    return float(np.mean([per_layer[layer][d, plan.removed(layer)].sum() / per_layer[layer][d].sum()
                          for layer in plan.layers]))  # fmt: skip


def rows(check: dict, trace: Trace):
    """(criterion, sparsity, domain, Δ, removed load share, removed saliency share) per arm (random: per seed)."""
    load, mass = domain_masses(trace)
    for arm in check["arms"]:
        if arm["n_keep"] == check["n_experts"]:
            continue  # removes nothing (the groups-dropped arm)
        names = [f"random (seed {s})" for s in arm["seeds"]] if arm["criterion"] == "random" else [arm["criterion"]]
        results = arm.get("per_seed") or [arm]
        for name, result in zip(names, results, strict=True):
            scores = {int(layer): np.array(v) for layer, v in check["scores"][name].items()}
            plan = KeepPlan.from_scores(scores, arm["n_keep"], 1 if check.get("ungrouped") else check["n_group"])
            for d, domain in enumerate(trace.domains):
                delta = result["by_domain"][domain]["delta"]
                yield arm["criterion"], arm["sparsity"], domain, delta, removed_share(load, plan, d), removed_share(
                    mass, plan, d)  # fmt: skip


def concentration_and_overlap(check: dict, trace: Trace) -> None:
    """Per MoE layer: the share of the calibration saliency mass on the layer's most salient half of the experts
    (concentration), and the mean cosine similarity of two domains' saliency mass over the experts (overlap); then a
    domain's mean overlap with the others against its mean Δ under the criteria other than random, per sparsity."""
    _, mass = domain_masses(trace)
    D = len(trace.domains)
    per_domain = np.zeros(D)
    print("| layer | saliency mass on the top half of the experts | mean cosine of two domains' saliency mass |")
    print("|---|---|---|")
    for layer, m in mass.items():
        total = np.sort(m.sum(0))[::-1]
        p = m / np.linalg.norm(m, axis=1, keepdims=True)
        cos = p @ p.T
        per_domain += (cos.sum(1) - 1) / (D - 1) / len(mass)
        print(f"| {layer} | {total[: len(total) // 2].sum() / total.sum():.3f} | "
              f"{cos[~np.eye(D, dtype=bool)].mean():.3f} |")  # fmt: skip
    print()
    print("| sparsity | ρ(a domain's mean overlap, its mean Δ over the informed criteria) |")
    print("|---|---|")
    for sparsity in sorted({a["sparsity"] for a in check["arms"] if a["n_keep"] < check["n_experts"]}):
        arms = [a for a in check["arms"] if a["sparsity"] == sparsity and a["criterion"] != "random"]
        cost = [np.mean([a["by_domain"][d]["delta"] for a in arms]) for d in trace.domains]
        print(f"| {sparsity:.3g} | {spearmanr(per_domain, cost)[0]:+.2f} |")
    print()


def main(folder: str) -> None:
    check = json.loads((Path(folder) / "check.json").read_text())
    trace = Trace(Path(folder) / "calibration_trace")
    concentration_and_overlap(check, trace)
    table = list(rows(check, trace))
    print("| sparsity | pairs | ρ(Δ, removed load share) | ρ(Δ, removed saliency share) |")
    print("|---|---|---|---|")
    for sparsity in [*sorted({r[1] for r in table}), None]:
        sel = [r for r in table if sparsity is None or r[1] == sparsity]
        delta, load, sal = (np.array([r[i] for r in sel]) for i in (3, 4, 5))
        print(f"| {'all' if sparsity is None else f'{sparsity:.3g}'} | {len(sel)} | {spearmanr(delta, load)[0]:+.3f} | "
              f"{spearmanr(delta, sal)[0]:+.3f} |")  # fmt: skip
    print()
    print("| criterion | sparsity | domain | Δ log-prob / token | removed load share | removed saliency share |")
    print("|---|---|---|---|---|---|")
    for criterion, sparsity, domain, delta, load, sal in table:
        print(f"| {criterion} | {sparsity:.3g} | {domain} | {delta:+.4f} | {load:.3f} | {sal:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1])
