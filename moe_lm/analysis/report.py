"""From traces to the report: metrics JSON, PNG figures, the HTML token view (and wandb, if the run has it).

Baselines drawn next to every number: (N0) the analytic uniform router, (N1) the same architecture at
initialisation (a trace of the untrained model on the same tokens), and (N2) domain labels shuffled among the
occurrences of each token id (what is left of domain specialisation once the token's identity is accounted for).
"""

from __future__ import annotations

import csv
import html
import json
from math import log
from pathlib import Path

import numpy as np

from moe_lm.analysis import metrics as M
from moe_lm.analysis import plots
from moe_lm.analysis.html import routing_page
from moe_lm.analysis.trace import Trace
from moe_lm.data.tokenizer import Tokenizer


def domain_jsd(experts: np.ndarray, domain: np.ndarray, trace: Trace) -> np.ndarray:
    """Pairwise JSD (bits) between the expert-assignment distributions of the domains present in `domain`."""
    return M.domain_jsd(M.domain_expert_counts(experts, domain, len(trace.domains), trace.n_experts))


def layer_metrics(trace: Trace, layer: int, min_count: int, n_boot: int, shuffled_domain: np.ndarray) -> dict:
    """Every per-layer number of the report; `shuffled_domain` is the N2 baseline's labels (drawn once)."""
    experts = np.asarray(trace.experts(layer))
    counts = M.expert_counts(experts, trace.n_experts)
    shares = M.domain_shares(experts, trace.domain, len(trace.domains), trace.n_experts)
    jsd = domain_jsd(experts, trace.domain, trace)
    return {
        "maxvio_global": M.max_vio(counts),
        "load": counts.tolist(),
        "load_entropy": M.load_entropy(counts),
        "dead_experts": M.dead_experts(counts),
        "repetition": M.repetition_with_ci(experts, trace.doc, n_boot),
        "domain_token_share": shares["token_share"].tolist(),
        "domain_relative_load": shares["relative_load"].tolist(),
        "domain_jsd_bits": jsd.tolist(),
        "mean_domain_jsd_bits": M.mean_pairwise(jsd),
        "mean_domain_jsd_bits_token_shuffled_N2": M.mean_pairwise(domain_jsd(experts, shuffled_domain, trace)),
        "vocabulary_specialisation": M.vocabulary_specialisation(experts, trace.token, trace.n_experts, min_count),
        "coactivation": M.coactivation(experts, trace.n_experts).tolist(),
    }


def chosen_token_ids(tok, texts: list[str]) -> dict[str, int]:
    """Token ids for the requested tokens, by piece (e.g. '▁the', 'Ġthe') or by text that encodes to one piece."""
    found = {}
    for text in texts:
        for candidate in (text, "\u2581" + text, "\u0120" + text):
            pid = tok.piece_to_id(candidate)
            if pid is not None:
                found[candidate] = pid
                break
        else:
            ids = tok.encode(text)
            if len(ids) == 1:
                found[tok.id_to_piece(ids[0])] = ids[0]
    return found


MAX_DEFAULT_FIGURE_LAYERS = 8


def figure_layers(layers: list[int], chosen: list[int] | None = None) -> list[int]:
    """The layers drawn per layer: `chosen`, or all of them up to MAX_DEFAULT_FIGURE_LAYERS, else the first, middle
    and last MoE layers (a 58-MoE-layer model would otherwise draw 174 figures; metrics cover every layer)."""
    if chosen:
        unknown = sorted(set(chosen) - set(layers))
        if unknown:
            raise ValueError(f"--layers {unknown} are not MoE layers of this model (those are {layers})")
        return sorted(set(chosen))
    if len(layers) <= MAX_DEFAULT_FIGURE_LAYERS:
        return list(layers)
    return sorted({layers[0], layers[len(layers) // 2], layers[-1]})


def build_report(
    trace: Trace,
    out: Path,
    tok: Tokenizer,
    tokens: list[str],
    init_trace: Trace | None = None,
    compare_trace: Trace | None = None,
    compare_label: str = "",
    metrics_rows: list[dict] | None = None,
    min_count: int = 20,
    n_boot: int = 500,
    html_tokens: int = 250,
    layers_to_draw: list[int] | None = None,
) -> dict:
    """Write metrics.json, metrics.csv (tidy: layer x domain x expert), figures/*.png and routing.html into `out`;
    returns the metrics. Per-layer figures and preferred-token tables for `figure_layers(...)`, numbers for all."""
    out.mkdir(parents=True, exist_ok=True)
    figs = out / "figures"
    figs.mkdir(exist_ok=True)
    E, K, layers, domains = trace.n_experts, trace.k, trace.layers, trace.domains
    drawn = figure_layers(layers, layers_to_draw)
    n_per_domain = np.bincount(np.asarray(trace.domain, np.int64), minlength=len(domains))
    result: dict = {
        "trace": {
            "tokens": trace.n,
            "documents": trace.meta["n_docs"],
            "layers": layers,
            "n_experts": E,
            "k": K,
            "domains": domains,
            "tokens_per_domain": n_per_domain.tolist(),
            "documents_per_domain": _documents_per_domain(trace).tolist(),
            "sampling": trace.meta["source"].get("sampling"),  # the budget's shares, when the caller recorded them
            "recording_tokens_per_s": trace.meta.get("tokens_per_s"),
        },
        "baseline_uniform_N0": {
            **M.repetition_baseline(E, K),
            "token_share": K / E,
            "assignment_share": 1 / E,
            "coactivation": (K - 1) / (E - 1) if E > 1 else 0.0,
            "load_entropy": log(E),
            "mean_domain_jsd_bits": 0.0,
            "maxvio_floor": M.max_vio_floor(trace.n, E, K, trials=50),
        },
        "layers": {},
        "figure_layers": drawn,
    }
    shuffled = M.shuffle_domains_within_token(trace.token, trace.domain)  # one N2 draw for every layer
    for layer in layers:
        lm = layer_metrics(trace, layer, min_count, n_boot, shuffled)
        result["layers"][str(layer)] = lm
        if layer not in drawn:
            continue
        lm["preferred_tokens"] = M.preferred_tokens(np.asarray(trace.experts(layer)), trace.token, E, min_count)
        plots.save(
            plots.domain_expert_bars(np.array(lm["domain_token_share"]), domains, K, layer, n_per_domain),
            figs / f"domain_experts_L{layer}.png",
        )
        plots.save(
            plots.relative_load_heatmap(np.array(lm["domain_relative_load"]), domains, layer),
            figs / f"relative_load_L{layer}.png",
        )
        plots.save(
            plots.coactivation_heatmap(np.array(lm["coactivation"]), layer, K), figs / f"coactivation_L{layer}.png"
        )
    if init_trace is not None:
        result["init_N1"] = {
            str(layer): {
                "repetition": M.repetition(np.asarray(init_trace.experts(layer)), init_trace.doc),
                "mean_domain_jsd_bits": M.mean_pairwise(
                    domain_jsd(np.asarray(init_trace.experts(layer)), init_trace.domain, init_trace)
                ),
                "vocabulary_specialisation": M.vocabulary_specialisation(
                    np.asarray(init_trace.experts(layer)), init_trace.token, E, min_count
                ),
            }
            for layer in layers
        }
    init_rep = {layer: result["init_N1"][str(layer)]["repetition"] for layer in layers} if init_trace else None
    plots.save(
        plots.repetition_by_layer(
            layers,
            {layer: result["layers"][str(layer)]["repetition"] for layer in layers},
            result["baseline_uniform_N0"],
            init_rep,
        ),
        figs / "repetition.png",
    )
    result["tokens"] = {}
    for piece, token_id in chosen_token_ids(tok, tokens).items():
        rows, count = [], 0
        for layer in layers:
            share, count = M.token_expert_share(np.asarray(trace.experts(layer)), trace.token, token_id, E)
            rows.append(share)
        if count == 0:
            continue
        result["tokens"][piece] = {"id": token_id, "count": count, "share_by_layer": np.array(rows).tolist()}
        safe = "".join(c if c.isalnum() else f"_{ord(c):x}" for c in piece)
        plots.save(plots.token_across_layers(np.array(rows), layers, piece, count, K), figs / f"token_{safe}.png")
    if compare_trace is not None:
        sat = {
            layer: M.saturation(np.asarray(trace.experts(layer)), np.asarray(compare_trace.experts(layer)))
            for layer in layers
        }
        result["saturation"] = {"against": compare_label, **{str(k): v for k, v in sat.items()}, "baseline": K / E}
        plots.save(plots.saturation_by_layer(layers, sat, K, E, compare_label), figs / "saturation.png")
    if metrics_rows:
        train = [r for r in metrics_rows if r["kind"] == "train"]
        evals = [r for r in metrics_rows if r["kind"] == "eval"]
        plots.save(plots.load_over_training(train, evals, layers), figs / "load_over_training.png")
    preferred = {layer: result["layers"][str(layer)]["preferred_tokens"] for layer in drawn}
    (out / "routing.html").write_text(
        routing_page(
            _samples(trace, tok, html_tokens),
            layers,
            E,
            "Routing: first-choice expert per token",
            coverage_table(result["trace"]) + preferred_tables(preferred, tok, min_count),
        )
    )
    write_tidy(result, out / "metrics.csv")
    (out / "metrics.json").write_text(json.dumps(result, indent=1))
    return result


def write_tidy(result: dict, path: Path) -> None:
    """One row per layer x domain x expert: the domain's tokens, token-slots to the expert, its token share (a
    domain's sum to K), assignment share (sum to 1) and relative load (mean 1), for re-plotting elsewhere."""
    domains, K = result["trace"]["domains"], result["trace"]["k"]
    tokens = result["trace"]["tokens_per_domain"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["layer", "domain", "expert", "domain_tokens", "token_slots", "token_share", "assignment_share",
                    "relative_load"])  # fmt: skip
        for layer, lm in result["layers"].items():
            for d, name in enumerate(domains):
                for e, share in enumerate(lm["domain_token_share"][d]):
                    slots = round(share * tokens[d])
                    w.writerow([layer, name, e, tokens[d], slots, share, share / K, lm["domain_relative_load"][d][e]])


def _documents_per_domain(trace: Trace) -> np.ndarray:
    """[D] documents of each domain in the trace (a document's tokens all carry its domain)."""
    first = np.unique(np.asarray(trace.doc), return_index=True)[1]
    return np.bincount(np.asarray(trace.domain, np.int64)[first], minlength=len(trace.domains))


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


def _samples(trace: Trace, tok: Tokenizer, n_tokens: int) -> list[dict]:
    """The first document (up to n_tokens) of each domain, with its routing in every layer."""
    samples = []
    domain = np.asarray(trace.domain)
    doc = np.asarray(trace.doc)
    for d, name in enumerate(trace.domains):
        rows = np.flatnonzero(domain == d)
        if len(rows) == 0:
            continue
        rows = rows[doc[rows] == doc[rows[0]]][:n_tokens]
        samples.append(
            {
                "domain": name,
                "pieces": [tok.id_to_piece(int(t)) for t in np.asarray(trace.token)[rows]],
                "experts": {layer: np.asarray(trace.experts(layer))[rows].tolist() for layer in trace.layers},
                "weights": {
                    layer: np.asarray(trace.weights(layer))[rows].astype(float).tolist() for layer in trace.layers
                },
            }
        )
    return samples
