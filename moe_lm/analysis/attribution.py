"""Where a model's drift comes from: its weights, the experts it picks, or the gate values it gives them.

R is the reference (weights w0; in each MoE layer, routes r0 = experts e0 and gate values g0), O another model of
the same architecture (another dtype, a quantised copy, another checkpoint: w1, r1 = (e1, g1)). f(r, w) is a
token's log-prob under weights w with routes r forced in every MoE layer (moe_lm/routing/forced.py). Every window
runs six times, plus once per MoE layer:

    RR = f(r0, w0)            R as it runs                OO = f(r1, w1)           O as it runs
    OR = f(r0, w1)            O with R's routes           RO = f(r1, w0)           R with O's routes
    RF = f((e1, gR(e1)), w0)  R with O's experts, its own gate values for them
    OF = f((e0, gO(e0)), w1)  O with R's experts, its own gate values (the experts-only replay of RL frameworks)
    OR@l                      O with R's routes in MoE layer l alone

gR(e) is R's router's gate values for the experts e: its unbiased scores at e, normalised and scaled as the model
does, at the pass's own hidden states. Where a layer picks the same set of experts in both models for a token, RF
and OF keep the model's own experts there, so that only the tokens whose set differs change what RR and OO compute.

Each token's change OO - RR splits exactly, in either order of the two factors (no further pass):

    reference first: weights OR - RR (at R's routes), routing RO - RR (at R's weights), interaction the rest,
                     OO - OR - RO + RR
    other first:     weights OO - RO (at O's routes), routing OO - OR (at O's weights): each holds the interaction
    Shapley:         the average of the two orders: weights + routing = total, nothing left over

and each routing part splits exactly into flips (the change of experts) and gate values (the rest):

    at R's weights:  flips RF - RR (at R's gate values), gate values RO - RF (at O's experts)
    at O's weights:  gate values OF - OR (at R's experts), flips OO - OF (at O's gate values)
    Shapley:         the average of the two.

The gate-value part holds the drift of the gate values of every token, those whose experts did not change too;
the flips part is the change of experts alone. A token's flips part is not only its own flip: an earlier token's
reaches it through attention (it is 0, to float32 rounding, for a token with no flip at or before it in its
window). The parts are signed and cancel over tokens, so each comes with its mean absolute value. What routing
replay leaves: |OR - RR|
(experts and gate values replayed) and |OF - RR| (experts only). Per MoE layer, OO - OR@l is the change that layer's
routing alone carries at O's weights; the layers' parts do not add up to a routing part (layers interact, and the
weights are O's). Means per token with 95 % intervals from resampling whole documents, overall and per domain (a
domain's interval rests on its few documents: indicative). Our Transformer only (both models).
"""

from __future__ import annotations

import numpy as np
import torch

from moe_lm.analysis.agreement import document_draws, mean_with_interval
from moe_lm.analysis.recording import document_windows
from moe_lm.errors import DataError
from moe_lm.routing.forced import decoder_routes, forced_routes
from moe_lm.routing.torch_routing import window_logprobs

# part: (later pass, earlier pass); per token the part is later - earlier (the module's docstring)
DIFFERENCES = {
    "total": ("OO", "RR"),
    "weights": ("OR", "RR"),
    "routing": ("RO", "RR"),
    "flips": ("RF", "RR"),
    "gate_values": ("RO", "RF"),
    "weights_at_other_routes": ("OO", "RO"),
    "routing_at_other_weights": ("OO", "OR"),
    "flips_at_other_weights": ("OO", "OF"),
    "gate_values_at_other_weights": ("OF", "OR"),
}
SHAPLEY = {  # the average of the two orders
    "shapley_weights": ("weights", "weights_at_other_routes"),
    "shapley_routing": ("routing", "routing_at_other_weights"),
    "shapley_flips": ("flips", "flips_at_other_weights"),
    "shapley_gate_values": ("gate_values", "gate_values_at_other_weights"),
}
PARTS = (*DIFFERENCES, "interaction", *SHAPLEY)


def flipped(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T] whether each token's set of experts differs between a and b [T, K] (their order aside)."""
    return (a.sort(-1).values != b.sort(-1).values).any(-1)


def their_experts(theirs: dict, own: dict) -> dict:
    """Routes to force: `theirs`' experts where a token's set differs from `own`, `own`'s elsewhere (the same set:
    the model's own order, so that the pass computes exactly what the model does there); the gate values are the
    forced model's own (forced_routes(..., weights=False))."""
    out = {}
    for layer, (idx, w) in own.items():
        take = flipped(theirs[layer][0], idx)[:, None]
        out[layer] = (torch.where(take, theirs[layer][0], idx), w)
    return out


@torch.no_grad()
def window_passes(ref, other, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """The log-probs [S] of one window under each pass of the module's docstring (NaN first), by layer for OR@l;
    `elsewhere`: 1 for the tokens whose set of experts differs in some layer."""
    t = torch.as_tensor(tokens, dtype=torch.long)[None]

    def lp(model) -> np.ndarray:
        return window_logprobs(model(t).logits[0], t[0])

    with decoder_routes(ref) as recorded:
        out = {"RR": lp(ref)}
    r0 = dict(recorded.last)
    with decoder_routes(other) as recorded:
        out["OO"] = lp(other)
    r1 = dict(recorded.last)
    for name, model, routes, weights in (("OR", other, r0, True), ("RO", ref, r1, True),
                                         ("RF", ref, their_experts(r1, r0), False),
                                         ("OF", other, their_experts(r0, r1), False)):  # fmt: skip
        with forced_routes(model, routes, weights=weights):
            out[name] = lp(model)
    for layer, route in r0.items():
        with forced_routes(other, {layer: route}):
            out[f"OR@{layer}"] = lp(other)
    out["elsewhere"] = torch.stack([flipped(r0[i][0], r1[i][0]) for i in r0]).any(0).double().numpy()
    return out


def token_parts(lp: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per token: every part of the module's docstring, from the passes' log-probs."""
    parts = {name: lp[later] - lp[earlier] for name, (later, earlier) in DIFFERENCES.items()}
    parts["interaction"] = parts["total"] - parts["weights"] - parts["routing"]
    parts |= {name: (parts[a] + parts[b]) / 2 for name, (a, b) in SHAPLEY.items()}
    return parts


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
    draws = document_draws(doc_a, n_boot, seed)
    everything = np.ones(len(doc_a), bool)
    return {
        "all": summary(lp, doc_a, everything, draws),
        "by_domain": {
            name: summary(lp, doc_a, domain_a == i, draws) for i, name in enumerate(domains) if (domain_a == i).any()
        },  # fmt: skip
        "windows": seq_len,
    }


def summary(lp: dict[str, np.ndarray], doc: np.ndarray, rows: np.ndarray, draws: np.ndarray) -> dict:
    """Every part's mean over the tokens `rows` with its 95 % interval over documents, and its mean absolute value
    (signed parts cancel over tokens); what replay leaves; each layer's routing; how many tokens and documents."""
    # the draws resample every document; those without rows in the mask add nothing to its sums
    d, parts = doc[rows], token_parts(lp)
    elsewhere = lp["elsewhere"][rows] > 0

    def both(values: np.ndarray) -> dict:
        absolute = mean_with_interval(np.abs(values), d, draws)
        return mean_with_interval(values, d, draws) | {"mean_abs": absolute["mean"],
                                                       "abs_interval": absolute["interval"]}  # fmt: skip

    out = {part: both(values[rows]) for part, values in parts.items()}
    out |= {
        "abs_total": mean_with_interval(np.abs(parts["total"][rows]), d, draws),
        "abs_after_replay": mean_with_interval(np.abs(parts["weights"][rows]), d, draws),
        "abs_after_experts_only_replay": mean_with_interval(np.abs(lp["OF"] - lp["RR"])[rows], d, draws),
        "routed_elsewhere": mean_with_interval(elsewhere.astype(float), d, draws),
        # what a token whose experts changed loses by the change, at R's weights and gate values (null: none did)
        "flips_where_routed_elsewhere": mean_with_interval(parts["flips"][rows][elsewhere], d[elsewhere], draws)
        if elsewhere.any()
        else {"mean": float("nan"), "interval": [float("nan")] * 2},
        "routing_by_layer": {
            name[3:]: mean_with_interval((lp["OO"] - lp[name])[rows], d, draws) for name in lp if name.startswith("OR@")
        },  # fmt: skip
        "tokens": int(rows.sum()),
        "documents": int(len(np.unique(d))),
    }
    return out


def trace_documents(trace) -> list[tuple[int, np.ndarray]]:
    """(domain, token ids) of every document of a trace (moe_lm.routing.trace.Trace), as it was recorded."""
    doc = np.asarray(trace.doc)
    starts = np.flatnonzero(np.r_[True, doc[1:] != doc[:-1]])
    ends = np.r_[starts[1:], len(doc)]
    token, domain = np.asarray(trace.token, dtype=np.int64), np.asarray(trace.domain)
    return [(int(domain[a]), token[a:b]) for a, b in zip(starts, ends, strict=True)]


def same_architecture(ref, other, label: str) -> None:
    """A ValueError naming the first parameter whose name or shape differs: routes force only into the same model;
    a DataError naming the weights that are not finite (NaN or inf): every pass would be NaN."""
    mine, theirs = ref.state_dict(), other.state_dict()
    for name in sorted(set(mine) | set(theirs)):
        a, b = mine.get(name), theirs.get(name)
        if a is None or b is None or a.shape != b.shape:
            shown = lambda t: "absent" if t is None else tuple(t.shape)  # noqa: E731
            raise ValueError(f"{label}: {name} is {shown(b)}, the run's is {shown(a)}: not the run's architecture, "
                             "so its routes cannot be forced into it")  # fmt: skip
    bad = [name for name, t in theirs.items() if t.is_floating_point() and not bool(t.isfinite().all())]
    if bad:
        raise DataError(f"{label}: weights that are not numbers (NaN or inf) in {', '.join(bad[:3])}"
                        f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}: its drift cannot be split; give a "
                        "file whose weights are finite (export or download it again)")  # fmt: skip


def attribute_models(run, trace, others: dict, out, n_boot: int = 1000) -> dict:
    """`drift_attribution` of the run (RUN, TAG) against each other model (label -> a function of the run's
    ModelConfig that builds it: a GGUF file's weights dequantised, another checkpoint, a transformers folder
    imported) on the trace's own documents and windows; writes attribution.json (strict JSON: a mean without
    tokens is null) and attribution.md into `out`."""
    from moe_lm.analysis.attribution_report import attribution_table
    from moe_lm.analysis.report_files import strict_json
    from moe_lm.checkpoint.format import load_model

    cfg, ref, _ = load_model(*run)
    docs, seq_len = trace_documents(trace), int(trace.meta["windows"])
    results = {}
    for label, build in others.items():
        other = build(cfg.model)
        same_architecture(ref, other, label)
        print(f"drift of {label} split into weights and routing (routes forced, {len(docs)} documents)")
        results[label] = drift_attribution(ref, other, docs, trace.domains, seq_len, n_boot)
    (out / "attribution.json").write_text(strict_json(results))
    (out / "attribution.md").write_text(attribution_table(results))
    return results
