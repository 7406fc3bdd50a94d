"""Causal expert ablation: route around chosen experts and measure each domain's loss change, against controls.

Routing around an expert drops it just before the top-k: the router chooses its groups as always, then each token
takes its next choice within them, with the gate weights of what it now chooses (from the unbiased scores, as
always); a token whose kept groups hold fewer than k remaining experts takes its next choices from any group. It
is applied from outside, as a hook that replaces the router's output with the router's own maths (its group limit
and gate weights); the model code is untouched.

The effect is measured per document (summed token losses), so its intervals come from a bootstrap over documents;
the control for ablating n experts of a layer is ablating n other experts of that layer chosen at random.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from moe_lm.analysis.recording import document_windows
from moe_lm.routing.routed_model import Reroutable


@contextlib.contextmanager
def route_around(routing: Reroutable, layer: int, experts: Iterable[int]):
    """Within the block, MoE layer `layer` of `routing` never routes a token to `experts` (its routers' own rule with
    them dropped: `routing.reroute`, moe_lm/routing/around.py)."""
    router = routing.routers[layer]
    gone = sorted(set(experts))

    def hook(module, inputs, out):
        return routing.reroute(module, out, gone)

    handle = router.register_forward_hook(hook, prepend=True)  # why first: other hooks (a recorder) see the result
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def window_batches(docs: list[tuple[int, np.ndarray]], seq_len: int, batch: int = 16):
    """`docs` cut into windows of seq_len, those that predict a token in batches: (the windows, their tokens [B, S]
    right-padded with 0, the mask [B, S - 1] of the positions that predict a real token). Causal models only: the
    padding comes after every real token, so no real token sees it."""
    windows = [w for w in document_windows(docs, seq_len) if len(w.tokens) > 1]
    for i in range(0, len(windows), batch):
        part = windows[i : i + batch]
        S = max(len(w.tokens) for w in part)
        tokens = torch.zeros(len(part), S, dtype=torch.long)
        mask = torch.zeros(len(part), S - 1, dtype=torch.bool)
        for b, w in enumerate(part):
            tokens[b, : len(w.tokens)] = torch.from_numpy(np.asarray(w.tokens, np.int64))
            mask[b, : len(w.tokens) - 1] = True
        yield part, tokens, mask


def document_losses(forward, docs: list[tuple[int, np.ndarray]], seq_len: int, batch: int = 16):
    """Per document: (summed next-token loss, predicted tokens), `forward(tokens [B, S])` giving the logits.
    Documents are cut into windows of seq_len."""
    loss = np.zeros(len(docs))
    count = np.zeros(len(docs))
    for part, tokens, mask in window_batches(docs, seq_len, batch):
        logits = forward(tokens[:, :-1]).float().cpu()
        ce = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none") * mask
        for b, c in enumerate(part):
            loss[c.doc] += ce[b].sum().item()
            count[c.doc] += mask[b].sum().item()
    return loss, count


def delta_by_domain(base, ablated, domain, n_domains: int, n_boot: int = 1000, seed: int = 0) -> list[dict]:
    """Per domain: the change of mean token loss (ablated - base) and its 95 % document-bootstrap interval."""
    (bl, bc), (al, _) = base, ablated
    rng = np.random.default_rng(seed)
    out = []
    for d in range(n_domains):
        docs = np.flatnonzero((np.asarray(domain) == d) & (bc > 0))
        if len(docs) == 0:
            out.append({"delta": float("nan"), "ci95": [float("nan"), float("nan")], "documents": 0})
            continue
        diff, n = al[docs] - bl[docs], bc[docs]
        pick = rng.integers(0, len(docs), (n_boot, len(docs)))
        boot = diff[pick].sum(1) / n[pick].sum(1)
        lo, hi = np.percentile(boot, [2.5, 97.5])
        out.append({"delta": float(diff.sum() / n.sum()), "ci95": [float(lo), float(hi)], "documents": len(docs)})
    return out


def ablation_study(
    routing: Reroutable,
    docs: list[tuple[int, np.ndarray]],
    domains: list[str],
    targets: list[tuple[int, list[int]]],
    seq_len: int,
    controls: int = 3,
    n_boot: int = 1000,
    seed: int = 0,
) -> dict:
    """Δloss per domain for each target (layer, experts) and for `controls` random same-size sets of its layer
    (`routing`: a PyTorch model's, whose routers can be routed around)."""
    rng = np.random.default_rng(seed)
    domain = np.array([d for d, _ in docs])
    base = document_losses(routing.forward, docs, seq_len)
    E = routing.n_experts
    rows = []
    for layer, experts in targets:
        with route_around(routing, layer, experts):
            losses = document_losses(routing.forward, docs, seq_len)
            effect = delta_by_domain(base, losses, domain, len(domains), n_boot, seed)
        others = [e for e in range(E) if e not in experts]
        control_sets = [sorted(rng.choice(others, len(experts), replace=False).tolist()) for _ in range(controls)]
        control_effects = []
        for chosen in control_sets:
            with route_around(routing, layer, chosen):
                losses = document_losses(routing.forward, docs, seq_len)
            control_effects.append(delta_by_domain(base, losses, domain, len(domains), n_boot, seed))
        rows.append(
            {
                "layer": layer,
                "experts": list(experts),
                "by_domain": dict(zip(domains, effect, strict=True)),
                "controls": [
                    {"experts": c, "by_domain": dict(zip(domains, ce, strict=True))}
                    for c, ce in zip(control_sets, control_effects, strict=True)
                ],
            }
        )
    base_loss = {name: float(base[0][domain == d].sum() / max(base[1][domain == d].sum(), 1)) for d, name in
                 enumerate(domains)}  # fmt: skip
    return {"base_loss": base_loss, "ablations": rows}
