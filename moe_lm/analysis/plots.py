"""Figures (matplotlib, PNG): each function takes arrays and returns a Figure; every figure draws its baseline."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def domain_expert_bars(
    token_share: np.ndarray, domains: list[str], k: int, layer: int, n_tokens: np.ndarray, of: int | None = None
):
    """Mixtral Fig. 7 / OLMoE-style: per expert, one bar per domain = share of the domain's tokens routed to it
    (`of`: how many domains there are, when these are some of them)."""
    n_domains, E = token_share.shape
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * E * max(1, n_domains / 3)) + 2.2, 3.6))
    width = 0.8 / n_domains
    for d in range(n_domains):
        ax.bar(
            np.arange(E) + (d - (n_domains - 1) / 2) * width,
            token_share[d],
            width,
            label=f"{domains[d]} (n={int(n_tokens[d]):,})",
        )
    ax.axhline(k / E, color="black", ls="--", lw=1, label=f"uniform k/E = {k / E:.3f}")
    ax.set_xlabel("expert")
    ax.set_ylabel("share of domain's tokens")
    ax.set_xticks(np.arange(E))
    ax.set_title(f"Layer {layer}: expert selection by domain (a domain's bars sum to k = {k})"
                 f"{_some(n_domains, of)}", fontsize=10)  # fmt: skip
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def relative_load_heatmap(
    relative_load: np.ndarray, domains: list[str], layer: int, vmax: float | None = None, of: int | None = None
):
    """DeepSeek-V3 Fig. 9 style: load of each expert on each domain over the balanced load (1 = balanced)."""
    n_domains, E = relative_load.shape
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * E), 0.5 * n_domains + 1.6))
    im = ax.imshow(
        relative_load, aspect="auto", cmap="viridis", vmin=0, vmax=vmax or max(2.0, np.nanmax(relative_load))
    )
    ax.set_yticks(range(n_domains), domains)
    ax.set_xticks(range(E))
    ax.set_xlabel("expert")
    ax.set_title(f"Layer {layer}: relative expert load per domain (load / balanced load; uniform = 1)"
                 f"{_some(n_domains, of)}", fontsize=10)  # fmt: skip
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    return fig


def saliency_heatmap(saliency: np.ndarray, domains: list[str], layer: int, of: int | None = None):
    """REAP's saliency of each expert on each domain's tokens, each row over its own maximum (what `moe-lm prune
    --criterion reap --domains D` ranks by: within a row, the brightest are kept first)."""
    n_domains, E = saliency.shape
    top = saliency.max(axis=1, keepdims=True)
    shown = np.divide(saliency, top, out=np.zeros_like(saliency), where=top > 0)
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * E), 0.5 * n_domains + 1.6))
    im = ax.imshow(shown, aspect="auto", cmap="magma", vmin=0, vmax=1)
    ax.set_yticks(range(n_domains), domains)
    ax.set_xticks(range(E))
    ax.set_xlabel("expert")
    ax.set_title(f"Layer {layer}: REAP saliency per domain{_some(n_domains, of)}\n(mean gate x output norm of the "
                 "tokens routed to it; a row over its max)", fontsize=10)  # fmt: skip
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    return fig


def _some(shown: int, of: int | None) -> str:
    """A title's note when a figure draws some of the domains."""
    return (
        f"\n{shown} of {of:,} domains: those with the most tokens (metrics.csv holds every one)"
        if of and of > shown
        else ""
    )


def token_across_layers(shares: np.ndarray, layers: list[int], piece: str, count: int, k: int):
    """Expert distribution of one token id in every MoE layer (rows sum to k; uniform k/E per cell)."""
    E = shares.shape[1]
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * E), 0.45 * len(layers) + 1.6))
    im = ax.imshow(shares, aspect="auto", cmap="magma", vmin=0, vmax=1)
    ax.set_yticks(range(len(layers)), [f"layer {layer}" for layer in layers])
    ax.set_xticks(range(E))
    ax.set_xlabel("expert")
    ax.set_title(f"token {piece!r} (n={count:,}): share routed to each expert; uniform k/E = {k / E:.3f}", fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    return fig


def repetition_by_layer(layers: list[int], rep: dict[int, dict], baseline: dict, init: dict[int, dict] | None = None):
    """Mixtral Table 5 as a figure: same first choice and top-k overlap of adjacent tokens, with 95 % CIs."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    x = np.arange(len(layers))
    for ax, key, title in (
        (axes[0], "same_first", "same first choice"),
        (axes[1], "topk_overlap", "top-k sets overlap"),
    ):
        if rep[layers[0]][key] is None:  # experts recorded as sets: no first choice
            ax.set_title(f"consecutive tokens: {title}\n(not known: the record holds unranked experts)", fontsize=8)
            ax.set_xticks(x, [f"L{layer}" for layer in layers])
            continue
        vals = np.array([rep[layer][key] for layer in layers])
        cis = np.array([rep[layer].get(f"{key}_ci95", [v, v]) for layer, v in zip(layers, vals, strict=True)])
        ax.bar(x, vals, color="tab:blue", label="trained")
        ax.errorbar(x, vals, yerr=[vals - cis[:, 0], cis[:, 1] - vals], fmt="none", ecolor="black", capsize=3)
        if init:
            ax.scatter(
                x, [init[layer][key] for layer in layers], color="tab:orange", zorder=3, label="at initialisation"
            )
        ax.axhline(baseline[key], color="black", ls="--", lw=1, label=f"uniform random {baseline[key]:.3f}")
        ax.set_xticks(x, [f"L{layer}" for layer in layers])
        ax.set_ylim(0, 1)
        ax.set_title(f"consecutive tokens: {title}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def coactivation_heatmap(coact: np.ndarray, layer: int, k: int):
    E = len(coact)
    fig, ax = plt.subplots(figsize=(max(4.5, 0.3 * E + 2), max(3.8, 0.3 * E + 1)))
    im = ax.imshow(coact, cmap="Blues", vmin=0, vmax=max(1e-9, coact.max()))
    ax.set_xlabel("expert j")
    ax.set_ylabel("expert i")
    ax.set_title(f"Layer {layer}: co-activation N(i,j)/N(i); uniform (k-1)/(E-1) = {(k - 1) / (E - 1):.3f}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    return fig


def load_over_training(train_rows: list[dict], eval_rows: list[dict], layers: list[int]):
    """MaxVio_batch per layer over training steps, MaxVio_global at evaluations, and the bias spread."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for layer in layers:
        key = f"maxvio/layer_{layer}"
        pts = [(r["step"], r[key]) for r in train_rows if key in r]
        if pts:
            axes[0].plot(*zip(*pts, strict=True), lw=1, label=f"L{layer} batch")
        key = f"maxvio_global/layer_{layer}"
        pts = [(r["step"], r[key]) for r in eval_rows if key in r]
        if pts:
            axes[0].plot(*zip(*pts, strict=True), "o--", ms=3, lw=1, label=f"L{layer} global (eval)")
        key = f"bias_std/layer_{layer}"
        pts = [(r["step"], r[key]) for r in train_rows if key in r]
        if pts:
            axes[1].plot(*zip(*pts, strict=True), lw=1, label=f"L{layer}")
    axes[0].axhline(0, color="black", lw=0.8)
    axes[0].set_title("expert load imbalance (MaxVio; 0 = balanced)")
    axes[0].set_xlabel("step")
    axes[1].set_title("selection-bias spread (std over experts)")
    axes[1].set_xlabel("step")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def agreement_by_layer(layers: list[int], comparisons: dict[str, dict]):
    """Per compared subject (a line each): top-1 agreement and top-k overlap with the subject, per MoE layer, with
    their 95 % intervals over documents, and the chance level of the first (dotted)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    x = np.arange(len(layers))
    for i, (label, c) in enumerate(comparisons.items()):
        color = plt.cm.viridis(i / max(len(comparisons) - 1, 1))
        for ax, key in zip(axes, ("top1_agreement", "topk_overlap"), strict=True):
            rows = [c["layers"][str(layer)][key] for layer in layers]
            if rows[0] is None:  # a side recorded its experts as sets: no first choice
                continue
            mean = np.array([r["mean"] for r in rows])
            err = np.abs(np.array([r["interval"] for r in rows]).T - mean)
            ax.errorbar(x, mean, yerr=err, marker="o", ms=3, lw=1.2, capsize=2, color=color, label=label)
            chance = [c["layers"][str(layer)]["chance"][key] for layer in layers]
            ax.plot(x, chance, ls=":", lw=1, color=color)
    for ax, title in zip(axes, ("same first choice", "top-k overlap |A∩B| / k"), strict=True):
        ax.set_xticks(x, [f"L{layer}" for layer in layers])
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{title} with the subject (dotted: chance)", fontsize=9)
    axes[0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig


def ablation_heatmap(delta: np.ndarray, control: np.ndarray, targets: list[str], domains: list[str]):
    """Δloss (nats) per ablated target (rows) and domain (columns), the controls' mean Δ in brackets."""
    lim = max(float(np.nanmax(np.abs(delta))), 1e-6)
    fig, ax = plt.subplots(figsize=(1.6 * len(domains) + 2.5, 0.45 * len(targets) + 1.8))
    im = ax.imshow(delta, aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim)
    for i in range(len(targets)):
        for j in range(len(domains)):
            ax.text(j, i, f"{delta[i, j]:+.3f}\n({control[i, j]:+.3f})", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(domains)), domains, rotation=30, ha="right")
    ax.set_yticks(range(len(targets)), targets)
    ax.set_title("Loss change when routing around experts (controls: random experts of the layer)", fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.03, label="Δ loss (nats/token)")
    fig.tight_layout()
    return fig


def save(fig, path) -> None:
    fig.savefig(path, dpi=110)
    plt.close(fig)
