"""The report's files, drawn and written from its numbers (`report.routing_metrics`): metrics.json, metrics.csv
(tidy: layer x domain x expert), figures/*.png and routing.html. Nothing here reads a trace or computes a metric."""

from __future__ import annotations

import csv
import html
import json
from pathlib import Path

import numpy as np

from moe_lm.analysis import plots
from moe_lm.analysis.html import routing_page
from moe_lm.analysis.subjects import described
from moe_lm.data.tokenizer import Tokenizer


def write_report(
    result: dict,
    out: Path,
    tok: Tokenizer,
    samples: list[dict],
    metrics_rows: list[dict] | None = None,
    min_count: int = 20,
) -> None:
    """Write metrics.json, metrics.csv, figures/*.png and routing.html into `out` (created). `samples`: the page's
    documents (`report.page_samples`); `metrics_rows`: the run's metrics.jsonl rows (the load-over-training
    figure); `min_count`: the occurrences the preferred-token tables required, for their caption."""
    out.mkdir(parents=True, exist_ok=True)
    figs = out / "figures"
    figs.mkdir(exist_ok=True)
    draw_figures(result, figs, metrics_rows)
    (out / "routing.html").write_text(routing_html(result, samples, tok, min_count))
    write_tidy(result, out / "metrics.csv")
    (out / "metrics.json").write_text(strict_json(result))
    if result.get("comparisons"):
        (out / "comparisons.md").write_text(comparisons_markdown(result))


def strict_json(value) -> str:
    """`value` as JSON that every reader takes: a number that is not finite (a metric with no data: NaN) is null,
    never the `NaN` Python's json writes by default, which is not JSON."""

    def finite(v):
        if isinstance(v, float) and not np.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    return json.dumps(finite(value), indent=1, allow_nan=False)


def draw_figures(result: dict, figs: Path, metrics_rows: list[dict] | None = None) -> None:
    """Every PNG of the report into `figs`: per drawn layer, then across layers, per token, agreement with the
    compared subjects (when there are) and load over training (when the run's metrics are given)."""
    for layer in result["figure_layers"]:
        draw_layer(result, layer, figs)
    draw_repetition(result, figs)
    draw_tokens(result, figs)
    if result.get("comparisons"):
        plots.save(plots.agreement_by_layer(result["trace"]["layers"], result["comparisons"]), figs / "agreement.png")
    if metrics_rows:
        train = [r for r in metrics_rows if r["kind"] == "train"]
        evals = [r for r in metrics_rows if r["kind"] == "eval"]
        plots.save(plots.load_over_training(train, evals, result["trace"]["layers"]), figs / "load_over_training.png")


BAR_DOMAINS, HEATMAP_DOMAINS = 12, 64  # the domains a figure draws (its size grows with them); the tables hold all


def drawn_domains(tokens_per_domain: list[int], most: int) -> list[int]:
    """The `most` domains with the most tokens (ties: in order), in order: what a per-domain figure draws."""
    ranked = sorted(range(len(tokens_per_domain)), key=lambda d: (-tokens_per_domain[d], d))
    return sorted(ranked[:most])


def draw_layer(result: dict, layer: int, figs: Path) -> None:
    """One MoE layer's figures: expert shares per domain, relative load and REAP saliency (where the trace has the
    output norms) per domain (each of at most BAR_DOMAINS and HEATMAP_DOMAINS domains, the title saying so when
    there are more), co-activation."""
    meta, lm = result["trace"], result["layers"][str(layer)]
    domains, K, tokens = meta["domains"], meta["k"], meta["tokens_per_domain"]
    bars = drawn_domains(tokens, BAR_DOMAINS)
    plots.save(
        plots.domain_expert_bars(
            np.array(lm["domain_token_share"])[bars],
            [domains[d] for d in bars],
            K,
            layer,
            np.array(tokens)[bars],
            of=len(domains),
        ),
        figs / f"domain_experts_L{layer}.png",
    )
    rows = drawn_domains(tokens, HEATMAP_DOMAINS)
    plots.save(
        plots.relative_load_heatmap(
            np.array(lm["domain_relative_load"])[rows], [domains[d] for d in rows], layer, of=len(domains)
        ),
        figs / f"relative_load_L{layer}.png",
    )
    if "domain_saliency" in lm:
        plots.save(
            plots.saliency_heatmap(
                np.array(lm["domain_saliency"])[rows], [domains[d] for d in rows], layer, of=len(domains)
            ),
            figs / f"saliency_L{layer}.png",
        )
    plots.save(plots.coactivation_heatmap(np.array(lm["coactivation"]), layer, K), figs / f"coactivation_L{layer}.png")


def draw_repetition(result: dict, figs: Path) -> None:
    """Consecutive-token repetition by layer, against N0 and (when recorded) N1."""
    layers = result["trace"]["layers"]
    init = result.get("init_N1")
    init_rep = {layer: init[str(layer)]["repetition"] for layer in layers} if init is not None else None
    rep = {layer: result["layers"][str(layer)]["repetition"] for layer in layers}
    plots.save(plots.repetition_by_layer(layers, rep, result["baseline_uniform_N0"], init_rep), figs / "repetition.png")


def draw_tokens(result: dict, figs: Path) -> None:
    """Per requested token, its expert shares across layers (file names keep only alphanumerics of the piece)."""
    layers, K = result["trace"]["layers"], result["trace"]["k"]
    for piece, t in result["tokens"].items():
        safe = "".join(c if c.isalnum() else f"_{ord(c):x}" for c in piece)
        plots.save(
            plots.token_across_layers(np.array(t["share_by_layer"]), layers, piece, t["count"], K),
            figs / f"token_{safe}.png",
        )


def routing_html(result: dict, samples: list[dict], tok: Tokenizer, min_count: int) -> str:
    """routing.html: the sample documents coloured by first-choice expert, the per-domain coverage and the
    preferred-token tables of the drawn layers."""
    meta = result["trace"]
    preferred = {layer: result["layers"][str(layer)]["preferred_tokens"] for layer in result["figure_layers"]}
    return routing_page(
        samples,
        meta["layers"],
        meta["n_experts"],
        "Routing: first-choice expert per token",
        coverage_table(meta)
        + comparison_tables(result.get("comparisons") or {})
        + preferred_tables(preferred, tok, min_count),
    )


def write_tidy(result: dict, path: Path) -> None:
    """One row per layer x domain x expert: the domain's tokens, token-slots to the expert, its token share (a
    domain's sum to K), assignment share (sum to 1), relative load (mean 1) and REAP saliency (empty where the trace
    has no output norms), for re-plotting elsewhere."""
    domains, K = result["trace"]["domains"], result["trace"]["k"]
    tokens = result["trace"]["tokens_per_domain"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["layer", "domain", "expert", "domain_tokens", "token_slots", "token_share", "assignment_share",
                    "relative_load", "reap_saliency"])  # fmt: skip
        for layer, lm in result["layers"].items():
            salient = lm.get("domain_saliency")
            for d, name in enumerate(domains):
                for e, share in enumerate(lm["domain_token_share"][d]):
                    slots = round(share * tokens[d])
                    w.writerow([layer, name, e, tokens[d], slots, share, share / K, lm["domain_relative_load"][d][e],
                                "" if salient is None else salient[d][e]])  # fmt: skip


def coverage_table(meta: dict) -> str:
    """The tokens and documents each domain contributed, so that a thin domain is seen before its numbers are read."""
    sampling = meta.get("sampling") or {}
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{tokens:,}</td><td>{docs:,}</td>"
        f"<td>{'under-sampled' if sampling.get(name, {}).get('under_sampled') else ''}</td></tr>"
        for name, tokens, docs in zip(
            meta["domains"], meta["tokens_per_domain"], meta["documents_per_domain"], strict=True
        )
    )
    return (
        "<h3>Tokens per domain</h3><table class='pref'><tr><th>domain</th><th>tokens</th><th>documents</th><th></th>"
        f"</tr>{rows}</table>"
    )


def comparison_tables(comparisons: dict[str, dict]) -> str:
    """Per compared subject: per layer its agreement with the subject (intervals over documents, chance beside),
    flips and how many were near ties, and what the flips cost in log-prob."""
    parts = []
    for label, c in comparisons.items():
        rows = []
        for layer, m in c["layers"].items():
            t1, ov, fl = m["top1_agreement"], m["topk_overlap"], m["flip_rate"]
            first = ("not known (unranked experts)" if t1 is None else f"{t1['mean']:.4f} ({t1['interval'][0]:.4f}-"
                     f"{t1['interval'][1]:.4f}); chance {m['chance']['top1_agreement']:.3f}")  # fmt: skip
            rows.append(
                f"<tr><td>{layer}</td><td>{first}</td><td>{ov['mean']:.4f} ({ov['interval'][0]:.4f}-"
                f"{ov['interval'][1]:.4f}); chance {m['chance']['topk_overlap']:.3f}</td><td>{m['flips']:,} "
                f"({100 * fl['mean']:.3f} %), {_near_ties(m['flips_near_ties'])}</td></tr>"
            )
        any_layer, lp = c["tokens_differing_in_any_layer"], c.get("logprob") or {}
        cost = lp.get("all", {})
        cost_line = (f"; log-prob |Δ| mean {cost['mean_abs']:.2e}, p99 {cost['p99_abs']:.2e}, max {cost['max_abs']:.2e}"
                     if cost.get("tokens") else "")  # fmt: skip
        lo, hi = (100 * x for x in any_layer["interval"])
        parts.append(
            f"<h3>Against {html.escape(label)}</h3><p>Tokens whose experts differ in at least one layer: "
            f"{100 * any_layer['mean']:.3f} % ({lo:.3f}-{hi:.3f}); chance {100 * any_layer['chance']:.1f} %"
            f"{cost_line}.</p><table class='pref'><tr><th>layer</th><th>same first choice</th><th>top-k overlap</th>"
            "<th>flips</th></tr>" + "".join(rows) + "</table>"
        )
    return ("<h2>Compared subjects (the same token ids)</h2>" + "".join(parts)) if parts else ""


def comparisons_markdown(result: dict) -> str:
    """The compared subjects in one Markdown table (comparisons.md): per subject, the tokens whose experts differ in
    some layer, the flips per layer with their intervals, how many were near ties, what they cost in log-prob, and
    what the subject is (a GGUF file: the types its tensors hold)."""
    trace, comparisons = result["trace"], result["comparisons"]
    chance = max(c["tokens_differing_in_any_layer"]["chance"] for c in comparisons.values())
    lines = [
        f"Routing of {trace['tokens']:,} tokens ({trace['documents']} documents, {len(trace['domains'])} domains) "
        f"by the subject and by each compared subject on the same token ids, cut into the same windows of "
        f"{trace.get('windows') or '?'} tokens (the context restarts at each); intervals: 95 % over documents; two "
        f"routers choosing independently with these frequencies would differ in some layer on {100 * chance:.1f} % "
        "of tokens. Definitions: docs/analytics.md (Comparing subjects).",
        "",
        "| subject | tokens whose experts differ in some layer, % | flips per layer, % (95 % interval; chance) | "
        "flips that were near ties | log-prob \\|Δ\\| mean / p99 / max | what it is |",
        "|---|---|---|---|---|---|",
    ]
    for label, c in comparisons.items():
        any_layer, cost = c["tokens_differing_in_any_layer"], (c.get("logprob") or {}).get("all") or {}
        per_layer = "; ".join(
            f"L{layer} {100 * m['flip_rate']['mean']:.2f} ({100 * m['flip_rate']['interval'][0]:.2f}-"
            f"{100 * m['flip_rate']['interval'][1]:.2f}; chance {100 * m['chance'].get('flip_rate', float('nan')):.0f})"
            for layer, m in c["layers"].items()
        )
        flips = sum(m["flips"] for m in c["layers"].values())
        known = [m["flips_near_ties"] for m in c["layers"].values() if m["flips_near_ties"] is not None]
        near = f"{sum(known):,} of {flips:,}" if known else f"margins not recorded, {flips:,} flips"
        lo, hi = (100 * x for x in any_layer["interval"])
        gap = (f"{cost['mean_abs']:.2e} / {cost['p99_abs']:.2e} / {cost['max_abs']:.2e}" if cost.get("tokens")
               else "not recorded")  # fmt: skip
        what = described(c.get("provenance") or {})
        lines.append(
            f"| {label} | {100 * any_layer['mean']:.2f} ({lo:.2f}-{hi:.2f}) | {per_layer} | {near} | {gap} | {what} |"
        )
    return "\n".join(lines) + "\n"


def _near_ties(n: int | None) -> str:
    return "near ties not known (no decision margins recorded)" if n is None else f"{n:,} near ties"


def preferred_tables(preferred: dict[int, list[list[dict]]], tok: Tokenizer, min_count: int) -> str:
    """HTML tables: per drawn layer and expert, its most preferred tokens with lift, share and count."""
    parts = [
        f"<h2>Most preferred tokens per expert</h2><p>Tokens seen at least {min_count} times, ranked by lift = "
        "P(expert in top-k | token) / P(expert in top-k); share = P(expert in top-k | token); n = occurrences.</p>"
    ]
    for layer, experts in preferred.items():
        rows = []
        for e, top in enumerate(experts):
            cells = " ".join(
                f"<code>{html.escape(repr(tok.id_to_piece(t['token']).replace(chr(0x2581), ' ')))}</code> "
                f"×{t['lift']:.1f} ({t['share']:.0%}, n={t['count']})"
                for t in top
            )
            rows.append(f"<tr><td>e{e}</td><td>{cells or '-'}</td></tr>")
        parts.append(f"<h3>layer {layer}</h3><table class='pref'>{''.join(rows)}</table>")
    return "".join(parts)
