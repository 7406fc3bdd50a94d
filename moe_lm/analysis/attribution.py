"""Where a model's drift comes from: its routing or its weights. For a reference R and another model O of the same
architecture (another dtype, a quantised copy, another checkpoint), every window runs five times:

    RR   R with its own routes                  OO   O with its own routes
    OR   O with R's routes (experts and gate weights: only O's weights differ from RR)
    ORe  O with R's experts and its own gate weights for them (experts-only replay, as RL frameworks replay)
    RO   R with O's routes (only the routing differs from RR)

and each token's log-prob change splits as a 2 x 2 design: total OO - RR = weights (OR - RR, at R's routes) +
routing (RO - RR, at R's weights) + interaction (the rest). Replay's residuals say what routing replay leaves:
|OR - RR| (experts and weights replayed) and |ORe - RR| (experts only). Per MoE layer, O with R's routes in that
layer alone: OO - O(R@l) is the part of the change that layer's routing carries (with O's weights). Means per token
with 95 % intervals from resampling whole documents, overall and per domain. Our Transformer only (both models):
routes are forced through its routers (moe_lm/routing/forced.py).
"""

from __future__ import annotations

import numpy as np
import torch

from moe_lm.analysis.agreement import document_draws, mean_with_interval
from moe_lm.analysis.recording import document_windows
from moe_lm.routing.forced import decoder_routes, forced_routes
from moe_lm.routing.torch_routing import window_logprobs

PARTS = ("total", "weights", "routing", "interaction")


@torch.no_grad()
def window_passes(ref, other, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """The log-probs [S] of one window under each pass of the module's docstring (NaN first), by layer for O(R@l)."""
    t = torch.as_tensor(tokens, dtype=torch.long)[None]

    def lp(model) -> np.ndarray:
        return window_logprobs(model(t).logits[0], t[0])

    with decoder_routes(ref) as recorded:
        out = {"RR": lp(ref)}
    ref_routes = dict(recorded.last)
    with decoder_routes(other) as recorded:
        out["OO"] = lp(other)
    other_routes = dict(recorded.last)
    with forced_routes(other, ref_routes):
        out["OR"] = lp(other)
    with forced_routes(other, ref_routes, weights=False):
        out["ORe"] = lp(other)
    with forced_routes(ref, other_routes):
        out["RO"] = lp(ref)
    for layer, route in ref_routes.items():
        with forced_routes(other, {layer: route}):
            out[f"OR@{layer}"] = lp(other)
    # tokens whose set of experts differs in some layer (O's own routes against R's)
    differs = [(a[0].sort(-1).values != b[0].sort(-1).values).any(-1) for a, b in
               ((ref_routes[layer], other_routes[layer]) for layer in ref_routes)]  # fmt: skip
    out["elsewhere"] = torch.stack(differs).any(0).double().numpy()
    return out


def drift_attribution(ref, other, docs, domains: list[str], seq_len: int, n_boot: int = 1000, seed: int = 0) -> dict:
    """The split of the module's docstring for the documents `docs` [(domain, token ids)] cut into windows of
    `seq_len` (both models in eval mode, the same MoE layers)."""
    if ref.moe_layer_ids() != other.moe_layer_ids():
        raise ValueError(f"MoE layers {ref.moe_layer_ids()} and {other.moe_layer_ids()}: not the same architecture")
    ref.eval()
    other.eval()
    rows: dict[str, list[np.ndarray]] = {}
    doc, domain = [], []
    for w in document_windows(docs, seq_len):
        for name, values in window_passes(ref, other, w.tokens).items():
            rows.setdefault(name, []).append(values[1:])  # the first token of a window has no log-prob (all rows)
        doc.append(np.full(len(w.tokens) - 1, w.doc))
        domain.append(np.full(len(w.tokens) - 1, w.domain))
    lp = {name: np.concatenate(v) for name, v in rows.items()}
    doc_a, domain_a = np.concatenate(doc), np.concatenate(domain)
    parts = token_parts(lp)
    layers = [int(name[3:]) for name in lp if name.startswith("OR@")]
    draws = document_draws(doc_a, n_boot, seed)

    def summary(rows_mask: np.ndarray) -> dict:
        # the draws resample every document; those without rows in the mask add nothing to its sums
        d = doc_a[rows_mask]
        out = {part: mean_with_interval(values[rows_mask], d, draws) for part, values in parts.items()}
        out["routing_by_layer"] = {str(layer): mean_with_interval((lp["OO"] - lp[f"OR@{layer}"])[rows_mask], d, draws)
                                   for layer in layers}  # fmt: skip
        out["tokens"] = int(rows_mask.sum())
        return out

    everything = np.ones(len(doc_a), bool)
    return {
        "all": summary(everything),
        "by_domain": {name: summary(domain_a == i) for i, name in enumerate(domains) if (domain_a == i).any()},
        "windows": seq_len,
    }


def token_parts(lp: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per token: the 2 x 2 split of the log-prob change and replay's residuals (absolute)."""
    total, weights, routing = lp["OO"] - lp["RR"], lp["OR"] - lp["RR"], lp["RO"] - lp["RR"]
    return {
        "total": total,
        "weights": weights,
        "routing": routing,
        "interaction": total - weights - routing,
        "abs_total": np.abs(total),
        "abs_after_replay": np.abs(weights),
        "abs_after_experts_only_replay": np.abs(lp["ORe"] - lp["RR"]),
        "routed_elsewhere": lp["elsewhere"],
    }


def trace_documents(trace) -> list[tuple[int, np.ndarray]]:
    """(domain, token ids) of every document of a trace (moe_lm.analysis.trace.Trace), as it was recorded."""
    doc = np.asarray(trace.doc)
    starts = np.flatnonzero(np.r_[True, doc[1:] != doc[:-1]])
    ends = np.r_[starts[1:], len(doc)]
    token, domain = np.asarray(trace.token, dtype=np.int64), np.asarray(trace.domain)
    return [(int(domain[a]), token[a:b]) for a, b in zip(starts, ends, strict=True)]


def same_architecture(ref, other, label: str) -> None:
    """A ValueError naming the first parameter whose name or shape differs: routes force only into the same model."""
    mine, theirs = ref.state_dict(), other.state_dict()
    for name in sorted(set(mine) | set(theirs)):
        a, b = mine.get(name), theirs.get(name)
        if a is None or b is None or a.shape != b.shape:
            shown = lambda t: "absent" if t is None else tuple(t.shape)  # noqa: E731
            raise ValueError(f"{label}: {name} is {shown(b)}, the run's is {shown(a)}: not the run's architecture, "
                             "so its routes cannot be forced into it")  # fmt: skip


def attribute_models(run, trace, others: dict, out, n_boot: int = 1000) -> dict:
    """`drift_attribution` of the run (RUN, TAG) against each other model (label -> a function of the run's
    ModelConfig that builds it: a GGUF file's weights dequantised, another checkpoint, a transformers folder
    imported) on the trace's own documents and windows; writes attribution.json and attribution.md into `out`."""
    import json

    from moe_lm.checkpoint.format import load_model

    cfg, ref, _ = load_model(*run)
    docs, seq_len = trace_documents(trace), int(trace.meta["windows"])
    results = {}
    for label, build in others.items():
        other = build(cfg.model)
        same_architecture(ref, other, label)
        print(f"drift of {label} split into weights and routing (routes forced, {len(docs)} documents)")
        results[label] = drift_attribution(ref, other, docs, trace.domains, seq_len, n_boot)
    (out / "attribution.json").write_text(json.dumps(results, indent=1))
    (out / "attribution.md").write_text(attribution_table(results))
    return results


def attribution_table(results: dict) -> str:
    """One row per compared model: the mean log-prob change per token and its parts (95 % intervals over
    documents), what replay leaves, and each MoE layer's routing share."""
    head = ("| model | tokens routed elsewhere in some layer | total change | weights | routing | interaction | mean "
            "abs change | left by replaying experts and weights | left by replaying experts only | routing, by MoE "
            "layer |")  # fmt: skip
    rows = [head, "|" + "---|" * 10]

    def cell(m: dict) -> str:
        lo, hi = m["interval"]
        return f"{m['mean']:+.4f} ({lo:+.4f}, {hi:+.4f})"

    for kind, r in results.items():
        a = r["all"]
        layers = "; ".join(f"L{layer} {m['mean']:+.4f}" for layer, m in a["routing_by_layer"].items())
        lo, hi = a["routed_elsewhere"]["interval"]
        cells = [f"{100 * a['routed_elsewhere']['mean']:.2f} % ({100 * lo:.2f}-{100 * hi:.2f})"]
        cells += [cell(a[p]) for p in (*PARTS, "abs_total", "abs_after_replay", "abs_after_experts_only_replay")]
        rows.append(f"| {kind} | " + " | ".join(cells) + f" | {layers} |")
    return "\n".join(rows) + "\n"
