"""From traces to the report's numbers: every metric the report shows, computed from the traces alone.

Baselines computed next to every number: (N0) the analytic uniform router, (N1) the same architecture at
initialisation (a trace of the untrained model on the same tokens), and (N2) domain labels shuffled among the
occurrences of each token id (what is left of domain specialisation once the token's identity is accounted for).
The files (metrics JSON and CSV, PNG figures, the HTML token view) are written from these numbers by
report_files.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import log
from pathlib import Path

import numpy as np

from moe_lm.analysis import metrics
from moe_lm.analysis.agreement import agreement
from moe_lm.analysis.report_files import write_report
from moe_lm.data.tokenizer import Tokenizer
from moe_lm.errors import ConfigError
from moe_lm.routing.trace import Trace

MAX_DEFAULT_FIGURE_LAYERS = 8


PAIR_TABLE_DOMAINS = 64  # the domain x domain JSD table is written up to this many domains (its size is quadratic)


def domain_counts(experts: np.ndarray, domain: np.ndarray, trace: Trace) -> np.ndarray:
    """[D, E] token-slots per domain and expert."""
    return metrics.domain_expert_counts(experts, domain, len(trace.domains), trace.n_experts)


def layer_metrics(trace: Trace, layer: int, min_count: int, n_boot: int, shuffled_domain: np.ndarray) -> dict:
    """Every per-layer number of the report; `shuffled_domain` is the N2 baseline's labels (drawn once)."""
    experts = np.asarray(trace.experts(layer))
    counts = metrics.expert_counts(experts, trace.n_experts)
    shares = metrics.domain_shares(experts, trace.domain, len(trace.domains), trace.n_experts)
    by_domain = domain_counts(experts, trace.domain, trace)
    table = metrics.domain_jsd_table(by_domain).tolist() if len(trace.domains) <= PAIR_TABLE_DOMAINS else None
    return {
        "maxvio_global": metrics.max_vio(counts),
        "load": counts.tolist(),
        "load_entropy": metrics.load_entropy(counts),
        "dead_experts": metrics.dead_experts(counts),
        "repetition": metrics.repetition_with_ci(experts, trace.doc, n_boot, trace.ranked),
        "domain_token_share": shares["token_share"].tolist(),
        "domain_relative_load": shares["relative_load"].tolist(),
        "domain_jsd_bits": table,  # None above PAIR_TABLE_DOMAINS domains (result["domain_pairs"] says so)
        "mean_domain_jsd_bits": metrics.mean_domain_jsd(by_domain),
        "mean_domain_jsd_bits_token_shuffled_N2": metrics.mean_domain_jsd(
            domain_counts(experts, shuffled_domain, trace)
        ),
        "vocabulary_specialisation": metrics.vocabulary_specialisation(
            experts, trace.token, trace.n_experts, min_count
        ),
        "coactivation": metrics.coactivation(experts, trace.n_experts).tolist(),
        **saliency(trace, layer, experts),
    }


def saliency(trace: Trace, layer: int, experts: np.ndarray) -> dict:
    """REAP's saliency per expert ("saliency", [E]) and per domain and expert ("domain_saliency", [D, E]): what
    `moe-lm prune --criterion reap` ranks experts by (docs/pruning.md); {} for a trace without the experts' output
    norms (another kind of subject, or recorded before them)."""
    norms, weights = trace.norms(layer), trace.weights(layer)
    if norms is None or weights is None:
        return {}
    E, D = trace.n_experts, len(trace.domains)
    return {
        "saliency": metrics.reap_saliency(experts, weights, norms, E)[0].tolist(),
        "domain_saliency": metrics.reap_saliency(experts, weights, norms, E, trace.domain, D).tolist(),
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


def figure_layers(layers: list[int], chosen: list[int] | None = None) -> list[int]:
    """The layers drawn per layer: `chosen`, or all of them up to MAX_DEFAULT_FIGURE_LAYERS, else the first, middle
    and last MoE layers (a 58-MoE-layer model would otherwise draw 174 figures; metrics cover every layer)."""
    if chosen:
        unknown = sorted(set(chosen) - set(layers))
        if unknown:
            raise ConfigError(f"layers {unknown} are not MoE layers of this model (those are {layers})")
        return sorted(set(chosen))
    if len(layers) <= MAX_DEFAULT_FIGURE_LAYERS:
        return list(layers)
    return sorted({layers[0], layers[len(layers) // 2], layers[-1]})


def routing_metrics(
    trace: Trace,
    tok: Tokenizer,
    tokens: list[str],
    init_trace: Trace | None = None,
    compared: tuple[tuple[str, Trace], ...] = (),
    min_count: int = 20,
    n_boot: int = 500,
    layers_to_draw: list[int] | None = None,
    no_untrained: str = "",
) -> dict:
    """Every number of the report (the content of metrics.json), from the traces alone.

    Keys, in this order (metrics.json keeps it): "trace" (what was recorded), "baseline_uniform_N0", "layers" (per
    MoE layer, keyed by str(layer); the drawn layers also carry "preferred_tokens"), "figure_layers" (the drawn
    layers: `figure_layers(trace.layers, layers_to_draw)`), "init_N1" (with `init_trace`), "tokens" (per requested
    token: its [L, E] expert shares) and "comparisons" (per `compared` subject, by its label: `agreement`); without
    N1, "init_N1_left_out" says why (`no_untrained`)."""
    drawn = figure_layers(trace.layers, layers_to_draw)
    result: dict = {
        "trace": trace_summary(trace),
        "baseline_uniform_N0": uniform_baseline(trace),
        "layers": all_layer_metrics(trace, drawn, min_count, n_boot),
        "figure_layers": drawn,
        "domain_pairs": domain_pairs(len(trace.domains)),
    }
    if init_trace is not None:
        result["init_N1"] = init_metrics(init_trace, trace.layers, trace.n_experts, min_count)
    elif no_untrained:
        result["init_N1_left_out"] = no_untrained
    result["tokens"] = token_shares(trace, chosen_token_ids(tok, tokens))
    if compared:
        result["comparisons"] = {
            label: {**agreement(trace, other, label, n_boot), "provenance": _compared_provenance(other)}
            for label, other in compared
        }
    return result


def domain_pairs(n_domains: int) -> dict:
    """How the domain JSD numbers cover the pairs of domains: the mean over every pair, or over MAX_PAIRS drawn at
    random when there are more (each baseline on the same draw); the per-pair table up to PAIR_TABLE_DOMAINS."""
    pairs = n_domains * (n_domains - 1) // 2
    return {"domains": n_domains, "pairs": pairs, "averaged_over": min(pairs, metrics.MAX_PAIRS),
            "sampled": pairs > metrics.MAX_PAIRS, "table": n_domains <= PAIR_TABLE_DOMAINS}  # fmt: skip


def _compared_provenance(other: Trace) -> dict:
    """What a compared subject was (a run, an HF folder, a GGUF file and the types its tensors hold), without the
    sampling its trace shares with the subject's."""
    return {k: v for k, v in other.provenance.items() if k not in ("sampling", "data")}


def trace_summary(trace: Trace) -> dict:
    """What was recorded: tokens, documents, shape of the routing, and what each domain contributed."""
    return {
        "tokens": trace.n,
        "documents": trace.meta["n_docs"],
        "layers": trace.layers,
        "n_experts": trace.n_experts,
        "k": trace.k,
        "windows": trace.meta.get("windows"),  # the context's cut: documents in windows of this many tokens
        "domains": trace.domains,
        "tokens_per_domain": np.bincount(np.asarray(trace.domain, np.int64), minlength=len(trace.domains)).tolist(),
        "documents_per_domain": _documents_per_domain(trace).tolist(),
        "sampling": trace.provenance.get("sampling"),  # the budget's shares, when the caller recorded them
        "recording_tokens_per_s": trace.meta.get("tokens_per_s"),
    }


def uniform_baseline(trace: Trace) -> dict:
    """N0: what a uniform random top-k router would give on this many tokens."""
    E, K = trace.n_experts, trace.k
    return {
        **metrics.repetition_baseline(E, K),
        "token_share": K / E,
        "assignment_share": 1 / E,
        "coactivation": (K - 1) / (E - 1) if E > 1 else 0.0,
        "load_entropy": log(E),
        "mean_domain_jsd_bits": 0.0,
        "maxvio_floor": metrics.max_vio_floor(trace.n, E, K, trials=50),
    }


def all_layer_metrics(trace: Trace, drawn: list[int], min_count: int, n_boot: int) -> dict[str, dict]:
    """`layer_metrics` of every MoE layer (keyed by str(layer)), with the preferred tokens of the `drawn` ones."""
    shuffled = metrics.shuffle_domains_within_token(trace.token, trace.domain)  # one N2 draw for every layer
    layers = {}
    for layer in trace.layers:
        lm = layer_metrics(trace, layer, min_count, n_boot, shuffled)
        if layer in drawn:  # why only these: the tables are what is read per layer, and they are long
            experts = np.asarray(trace.experts(layer))
            lm["preferred_tokens"] = metrics.preferred_tokens(experts, trace.token, trace.n_experts, min_count)
        layers[str(layer)] = lm
    return layers


def init_metrics(init_trace: Trace, layers: list[int], n_experts: int, min_count: int) -> dict[str, dict]:
    """N1: repetition, domain JSD and vocabulary specialisation of the untrained model, per layer (str keys)."""
    result = {}
    for layer in layers:
        experts = np.asarray(init_trace.experts(layer))
        result[str(layer)] = {
            "repetition": metrics.repetition(experts, init_trace.doc),
            "mean_domain_jsd_bits": metrics.mean_domain_jsd(domain_counts(experts, init_trace.domain, init_trace)),
            "vocabulary_specialisation": metrics.vocabulary_specialisation(
                experts, init_trace.token, n_experts, min_count
            ),
        }
    return result


def token_shares(trace: Trace, token_ids: dict[str, int]) -> dict[str, dict]:
    """Per token piece present in the trace: its id, occurrences and [L][E] share of them routed to each expert
    (a layer's row sums to K); pieces that never occur are left out."""
    result = {}
    for piece, token_id in token_ids.items():
        rows, count = [], 0
        for layer in trace.layers:
            experts = np.asarray(trace.experts(layer))
            share, count = metrics.token_expert_share(experts, trace.token, token_id, trace.n_experts)
            rows.append(share)
        if count == 0:
            continue
        result[piece] = {"id": token_id, "count": count, "share_by_layer": np.array(rows).tolist()}
    return result


def page_samples(trace: Trace, tok: Tokenizer, n_tokens: int) -> list[dict]:
    """The first document (up to n_tokens) of each domain, with its routing in every layer: what routing.html
    shows, as `routing_page` takes it ({"domain", "pieces", "experts": {layer: [N][K]}, "weights": ...})."""
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
                "weights": {  # None where the subject records no gate weights: the page shows the experts alone
                    layer: np.asarray(w)[rows].astype(float).tolist()
                    if (w := trace.weights(layer)) is not None
                    else None
                    for layer in trace.layers
                },
            }
        )
    return samples


@dataclass(frozen=True)
class ReportRequest:
    """What a routing report is made of: the trained model's trace and its tokenizer, the tokens to chart, and the
    baselines' traces."""

    trace: Trace
    tok: Tokenizer
    tokens: list[str]  # tokens whose routing across layers is charted
    init_trace: Trace | None = None  # the same tokens through the untrained model (baseline N1)
    # other subjects' traces of the same token ids, by label: their agreement with this one
    compared: tuple[tuple[str, Trace], ...] = ()
    no_untrained: str = ""  # why there is no N1 (a GGUF file's)
    metrics_rows: list[dict] | None = None  # the run's metrics.jsonl rows (load over training), if any
    min_count: int = 20  # minimum occurrences for vocabulary specialisation
    n_boot: int = 500  # bootstrap resamples of the confidence intervals
    html_tokens: int = 250  # tokens per domain on the HTML page
    layers_to_draw: list[int] | None = None


def build_report(req: ReportRequest, out: Path) -> dict:
    """Compute the report (`routing_metrics`) and write it into `out` (`write_report`: metrics.json, metrics.csv,
    figures/*.png, routing.html); returns the metrics. `metrics_rows`: the run's metrics.jsonl rows, if any."""
    result = routing_metrics(
        req.trace, req.tok, req.tokens, req.init_trace, req.compared, req.min_count, req.n_boot, req.layers_to_draw,
        req.no_untrained,
    )  # fmt: skip
    write_report(result, out, req.tok, page_samples(req.trace, req.tok, req.html_tokens), req.metrics_rows,
                 req.min_count)  # fmt: skip
    return result


def _documents_per_domain(trace: Trace) -> np.ndarray:
    """[D] documents of each domain in the trace (a document's tokens all carry its domain)."""
    first = np.unique(np.asarray(trace.doc), return_index=True)[1]
    return np.bincount(np.asarray(trace.domain, np.int64)[first], minlength=len(trace.domains))
