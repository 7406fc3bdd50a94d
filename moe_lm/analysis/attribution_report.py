"""attribution.md: the drift split of moe_lm/analysis/attribution.py as tables, each part named by what it measures
(its passes in the module's notation: R the run, O the compared model)."""

from __future__ import annotations

import math

# part: (its row's name, the passes it is the difference of), in the order the table shows them
ROWS = {
    "total": ("total change", "OO - RR"),
    "weights": ("weights, at the run's routes", "OR - RR"),
    "routing": ("routing, at the run's weights", "RO - RR"),
    "flips": ("- flips: its experts, the run's gate values for them", "RF - RR"),
    "gate_values": ("- gate values: its own, at its experts", "RO - RF"),
    "interaction": ("interaction (the rest of the total)", "OO - OR - RO + RR"),
    "weights_at_other_routes": ("weights, at its routes", "OO - RO"),
    "routing_at_other_weights": ("routing, at its weights", "OO - OR"),
    "gate_values_at_other_weights": ("- gate values: its own, at the run's experts", "OF - OR"),
    "flips_at_other_weights": ("- flips: its experts, at its gate values", "OO - OF"),
    "shapley_weights": ("weights, Shapley (the two orders' average)", "(OR - RR + OO - RO) / 2"),
    "shapley_routing": ("routing, Shapley", "(RO - RR + OO - OR) / 2"),
    "shapley_flips": ("- flips, Shapley", "(RF - RR + OO - OF) / 2"),
    "shapley_gate_values": ("- gate values, Shapley", "(RO - RF + OF - OR) / 2"),
}


def interval(m: dict, scale: float = 1.0, digits: int = 4, sign: str = "+") -> str:
    """'mean (lo, hi)', or '-' for a mean without tokens."""
    if m["mean"] is None or not math.isfinite(m["mean"]):
        return "-"
    lo, hi = m["interval"]
    return f"{scale * m['mean']:{sign}.{digits}f} ({scale * lo:{sign}.{digits}f}, {scale * hi:{sign}.{digits}f})"


def split_rows(results: dict) -> list[str]:
    rows = [
        "| model | part | passes | mean (95 % interval over documents) | mean absolute value |",
        "|---|---|---|---|---|",
    ]
    for label, r in results.items():
        a = r["all"]
        for i, (part, (name, passes)) in enumerate(ROWS.items()):
            absolute = {"mean": a[part]["mean_abs"], "interval": a[part]["abs_interval"]}
            rows.append(f"| {label if i == 0 else ''} | {name} | {passes} | {interval(a[part])} | "
                        f"{interval(absolute, sign='')} |")  # fmt: skip
    return rows


def replay_rows(results: dict) -> list[str]:
    rows = ["| model | tokens routed elsewhere in some layer (%) | their flips part (RF - RR, mean over them) | mean "
            "abs change | left by replaying experts and gate values (\\|OR - RR\\|) | left by replaying experts only "
            "(\\|OF - RR\\|) | routing one MoE layer at a time, at its weights (OO - OR@l: these do not add up to "
            "any routing part above; the layers interact) |", "|" + "---|" * 7]  # fmt: skip
    for label, r in results.items():
        a = r["all"]
        layers = "; ".join(f"L{layer} {m['mean']:+.4f}" for layer, m in a["routing_by_layer"].items())
        cells = [interval(a["routed_elsewhere"], 100, 2, ""), interval(a["flips_where_routed_elsewhere"])]
        cells += [interval(a[p], sign="") for p in ("abs_total", "abs_after_replay", "abs_after_experts_only_replay")]
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {layers} |")
    return rows


def domain_rows(results: dict) -> list[str]:
    rows = ["| model | domain | documents | tokens | total | weights, Shapley | routing, Shapley | flips, Shapley |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for label, r in results.items():
        for domain, m in r["by_domain"].items():
            cells = [interval(m[p]) for p in ("total", "shapley_weights", "shapley_routing", "shapley_flips")]
            rows.append(f"| {label} | {domain} | {m['documents']} | {m['tokens']:,} | " + " | ".join(cells) + " |")
    return rows


def attribution_table(results: dict) -> str:
    """The split per compared model (every part, signed and absolute), what replay leaves and each layer's routing,
    and the split per domain (indicative)."""
    text = [
        "Log-prob change per token, the compared model minus the run (nats; negative: it does worse). R: the run, O: "
        "the compared model; RF: R with O's experts and its own gate values for them, OF: O with R's experts and its "
        'own gate values (docs/analytics.md, "Where drift comes from").',
        "",
        *split_rows(results),
        "",
        *replay_rows(results),
        "",
        "Per domain: indicative (each interval rests on the domain's documents alone, as many as the column says).",
        "",
        *domain_rows(results),
    ]
    return "\n".join(text) + "\n"
