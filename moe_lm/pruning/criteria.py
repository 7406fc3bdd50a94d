"""How much each routed expert is worth keeping, per MoE layer: [E] scores, higher kept first.

From a routing trace (moe_lm/routing/trace.py), over its tokens (or those of the chosen domains), with X_j the
routed (token, slot) pairs that chose expert j, g_j(t) the gate weight the model applies in the combine and f_j(t)
the expert's output:

    frequency   |X_j|                                tokens routed to j
    gate-mass   Σ_{X_j} g_j(t)                       the gate weight j receives
    reap        (1 / |X_j|) Σ_{X_j} g_j(t) ‖f_j(t)‖₂  REAP (arXiv 2510.13999); 0 for an expert no token chose
    random      uniform in [0, 1), seeded            the control

and, from the model itself, `ablation`: the mean next-token loss on the calibration documents with j alone removed
(masked.py: its score masked before selection, group scores included) minus the loss with every expert: the
reference the cheaper criteria are judged by. It runs the documents once per expert and layer.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moe_lm.analysis.ablation import document_losses
from moe_lm.analysis.metrics import reap_saliency
from moe_lm.errors import UserError
from moe_lm.pruning.masked import removed
from moe_lm.routing.trace import Trace

FROM_TRACE = ("reap", "frequency", "gate-mass", "random")
CRITERIA = ("reap", "frequency", "gate-mass", "ablation", "random")


def domain_rows(trace: Trace, domains: list[str] | None) -> np.ndarray:
    """[N] bool: the trace's tokens of `domains` (None: all); a UserError naming its domains for one it lacks."""
    if not domains:
        return np.ones(trace.n, dtype=bool)
    check_domains(domains, trace.domains)
    rows = np.isin(np.asarray(trace.domain), [trace.domains.index(d) for d in domains])
    if not rows.any():
        raise UserError(f"--domains {' '.join(domains)}: no calibration token is of them")
    return rows


def check_domains(wanted: list[str] | None, domains: list[str]) -> None:
    """A UserError naming the calibration documents' `domains` for a wanted one they lack."""
    if unknown := [d for d in wanted or () if d not in domains]:
        raise UserError(f"--domains {' '.join(unknown)}: not a domain of the calibration documents "
                        f"({', '.join(domains)})")  # fmt: skip


def trace_scores(trace: Trace, criterion: str, domains: list[str] | None = None, seed: int = 0):
    """Per MoE layer id of the trace, the [E] scores of `criterion` (one of FROM_TRACE) over the tokens of `domains`."""
    rows = domain_rows(trace, domains)
    if criterion == "random":
        rng = np.random.default_rng(seed)
        return {layer: rng.random(trace.n_experts) for layer in trace.layers}
    need = {"gate-mass": ["weights"], "reap": ["weights", "norms"]}.get(criterion, [])
    if missing := [c for c in need if c not in trace.columns]:
        what = "the expert output norms" if "norms" in missing else "the gate weights"
        raise UserError(f"--criterion {criterion} needs {what}, which the trace {trace.folder} does not hold: record "
                        "it again with this version of moe-lm (leave out --trace, or moe-lm analyze)")  # fmt: skip
    return {layer: layer_scores(trace, layer, criterion, rows) for layer in trace.layers}


def layer_scores(trace: Trace, layer: int, criterion: str, rows: np.ndarray) -> np.ndarray:
    """[E] scores of one MoE layer over the trace rows `rows`."""
    E = trace.n_experts
    experts = np.asarray(trace.experts(layer))[rows]
    if criterion == "frequency":
        return np.bincount(experts.ravel(), minlength=E).astype(np.float64)
    weights = np.asarray(trace.weights(layer))[rows]
    if criterion == "gate-mass":
        return np.bincount(experts.ravel(), weights=weights.ravel().astype(np.float64), minlength=E)
    return reap_saliency(experts, weights, np.asarray(trace.norms(layer))[rows], E)[0]


def trace_documents(trace: Trace, domains: list[str] | None = None) -> list[tuple[int, np.ndarray]]:
    """The calibration documents a trace was recorded on, (domain index, token ids) each, of `domains` (None: all):
    its rows of one document are contiguous and in order."""
    doc = np.asarray(trace.doc)
    starts = np.flatnonzero(np.r_[True, doc[1:] != doc[:-1]])
    ends = np.r_[starts[1:], len(doc)]
    keep = domain_rows(trace, domains)
    token, domain = np.asarray(trace.token), np.asarray(trace.domain)
    return [(int(domain[a]), token[a:b].astype(np.int64)) for a, b in zip(starts, ends, strict=True) if keep[a]]


def ablation_scores(forward: Callable, routers: dict, n_experts: int, docs, seq_len: int, progress=None,
                    reroute=None):  # fmt: skip
    """Per MoE layer id of `routers`, [E]: the mean token loss on `docs` with that expert alone removed (masked.py;
    `reroute`: the rule of routers without a selection bias), minus the loss with all of them.
    `forward(tokens [B, S]) -> logits`; `progress(layer, expert)` is told each step."""
    base_loss, count = document_losses(forward, docs, seq_len)
    base = base_loss.sum() / max(count.sum(), 1)
    scores = {}
    for layer in sorted(routers):
        scores[layer] = np.zeros(n_experts)
        for e in range(n_experts):
            if progress is not None:
                progress(layer, e)
            with removed(routers, {layer: [e]}, reroute):
                loss, _ = document_losses(forward, docs, seq_len)
            scores[layer][e] = loss.sum() / max(count.sum(), 1) - base
    return scores
