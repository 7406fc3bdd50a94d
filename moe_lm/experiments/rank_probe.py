"""The `rank` experiment: attention-matrix rank of causal vs bidirectional (prefix) models, trained and untrained.

It probes the checkpoints of another experiment (mask: gpt-tgt is causal, unilm bidirectional over a 128-token
prefix; same parameters, labels, seeds) and, for each, the same architecture at its initialisation (the seed's
untrained twin). Per layer and head, on fixed validation windows: the full matrix, the prefix block (positions
< P: bidirectional vs lower-triangular) and the target block. Plus Dong et al.'s rank collapse of the hidden states
(also for an untrained 12-layer twin, where depth shows) and a model-free Gaussian control. Measures:
moe_lm/analysis/attention_probe.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from moe_lm.analysis.attention_probe import (
    attention_matrices,
    capture_attention,
    rank_metrics,
    relative_residual,
    synthetic_erank,
)
from moe_lm.checkpoint.format import load_model
from moe_lm.experiments import stats
from moe_lm.experiments.final_eval import probe_windows
from moe_lm.experiments.report import closing_sections
from moe_lm.experiments.runner import Run
from moe_lm.experiments.spec import Experiment
from moe_lm.model import Transformer, initial_model

BLOCKS = ("full", "prefix", "target")


@torch.no_grad()
def probe_model(model: Transformer, windows: torch.Tensor, prefix_len: int, batch: int = 8) -> dict:
    """Per layer: per-head means of every rank measure over the windows, for each block; the matrices' counts of
    (exactly, numerically) full rank; and the hidden states' relative residual."""
    model.eval()
    bidirectional = model.cfg.attn_mask == "prefix"
    P = prefix_len
    per_layer: dict[int, dict[str, list]] = {}
    residual: dict[int, list] = {}
    hooks = [
        block.register_forward_hook(lambda m, i, o, layer=layer: residual.setdefault(layer, []).append(
            relative_residual(o[0]).numpy()))
        for layer, block in enumerate(model.layers)
    ]  # fmt: skip
    try:
        for chunk in windows.split(batch):
            store = []
            with capture_attention(store):
                model(chunk[:, :-1], prefix_len=P if bidirectional else None)
            for layer, (q, k, _, mask, scale, gqa) in enumerate(store):
                A = attention_matrices(q, k, mask, scale, gqa)  # [B, H, S, S]
                parts = {"full": A, "prefix": A[..., :P, :P], "target": A[..., P:, P:]}
                acc = per_layer.setdefault(layer, {})
                for block, M in parts.items():
                    for name, value in rank_metrics(M).items():
                        acc.setdefault(f"{block}/{name}", []).append(value.double().numpy())
    finally:
        for h in hooks:
            h.remove()
    out = {"layers": {}, "residual": {}}
    for layer, acc in per_layer.items():
        entry = {}
        for key, values in acc.items():
            v = np.concatenate(values)  # [windows, heads]
            entry[key] = {"mean_by_head": v.mean(0).tolist(), "mean": float(v.mean()), "min": float(v.min())}
        S = windows.shape[1] - 1
        sizes = {"full": S, "prefix": P, "target": S - P}
        for block, n in sizes.items():
            entry[f"{block}/exactly_full_rank_share"] = float(
                np.mean(np.concatenate(acc[f"{block}/nonzero_diagonal"]) == n)
            )
            entry[f"{block}/numerically_full_rank_share"] = float(
                np.mean(np.concatenate(acc[f"{block}/rank_eps"]) == n)
            )
            entry[f"{block}/full_rank_at_1e-6_share"] = float(np.mean(np.concatenate(acc[f"{block}/rank_1e-06"]) == n))
        out["layers"][layer] = entry
    out["residual"] = {layer: float(np.concatenate(v).mean()) for layer, v in residual.items()}
    return out


def untrained_twin(cfg, **model_changes) -> Transformer:
    """The run's architecture at the initialisation training started from (the same seed)."""
    return initial_model(dataclasses.replace(cfg.model, **model_changes), cfg.seed).eval()


def run_rank_probe(exp: Experiment, runs: list[Run], out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    P = exp.score_from
    causal_arm, bidir_arm = exp.probe_arms
    results = {"experiment": exp.name, "claim": exp.claim, "prefix_len": P, "windows": exp.windows, "models": []}
    windows = None
    for run in sorted((r for r in runs if r.arm in exp.probe_arms), key=lambda r: (r.arm, r.seed)):
        cfg, model, _ = load_model(run.folder)
        windows = probe_windows(cfg, exp.windows) if windows is None else windows
        for state, m in (("trained", model), ("untrained", untrained_twin(cfg))):
            entry = {"arm": run.arm, "seed": run.seed, "state": state, **probe_model(m, windows, P)}
            results["models"].append(entry)
        if run.arm == causal_arm and run.seed == 0:  # depth: Dong et al.'s collapse in an untrained 12-layer twin
            deep = untrained_twin(cfg, n_layers=12, first_k_dense_replace=12)
            results["deep_untrained_residual"] = probe_model(deep, windows[:8], P)["residual"]
    results["synthetic"] = {"scales": [0, 1, 2, 4, 8, 16], **synthetic_erank(256, 32, [0, 1, 2, 4, 8, 16])}
    results["checks"] = checks(results, causal_arm, bidir_arm)
    mask_report = out.parent / exp.arms_from / "results.json"
    results["mask_verdict"] = _mask_verdict(mask_report, causal_arm, bidir_arm)
    results["verdict"] = _overall(results["checks"], results["mask_verdict"])
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    figures = draw(results, causal_arm, bidir_arm, out / "figures")
    (out / "report.md").write_text(markdown(exp, results, causal_arm, bidir_arm, figures))
    return results


def _mean_over_layers(entry: dict, key: str) -> float:
    return float(np.mean([layer[key]["mean"] for layer in entry["layers"].values()]))


def checks(results: dict, causal_arm: str, bidir_arm: str) -> list[dict]:
    models = results["models"]
    causal = [m for m in models if m["arm"] == causal_arm]
    exact = min(layer[f"{b}/exactly_full_rank_share"] for m in causal for layer in m["layers"].values() for b in BLOCKS)
    numeric = min(layer["full/numerically_full_rank_share"] for m in causal for layer in m["layers"].values())
    at_1e6 = min(layer["full/full_rank_at_1e-6_share"] for m in causal for layer in m["layers"].values())
    out = [{
        "name": "every causal attention matrix is exactly full rank (det = product of its positive diagonal)",
        "verdict": "supported" if exact == 1.0 else "contradicted",
        "why": f"share of causal matrices with no zero diagonal entry: {exact:.3f}; numerically full rank by SVD at "
        f"n*eps: at least {numeric:.3f} per layer; at 1e-6: at least {at_1e6:.3f}",
    }]  # fmt: skip
    for state in ("trained", "untrained"):
        seeds = sorted({m["seed"] for m in models if m["state"] == state})
        deltas = []
        for s in seeds:
            pick = {m["arm"]: m for m in models if m["state"] == state and m["seed"] == s}
            if causal_arm in pick and bidir_arm in pick:
                deltas.append(
                    _mean_over_layers(pick[bidir_arm], "prefix/erank")
                    - _mean_over_layers(pick[causal_arm], "prefix/erank")
                )
        if not deltas:
            continue
        mean, lo, hi = stats.t_interval(deltas)
        verdict, why = stats.verdict(deltas, lo, hi, "lower")
        out.append({
            "name": f"{state}: the bidirectional prefix block has a lower effective rank than the causal one "
            f"({bidir_arm} - {causal_arm}, mean over layers and heads)",
            "deltas": deltas, "mean": mean, "t_interval": [lo, hi],
            "verdict": verdict if state == "trained" else f"context ({verdict})", "why": why,
        })  # fmt: skip
    return out


def _mask_verdict(path: Path, causal_arm: str, bidir_arm: str) -> str | None:
    if not path.is_file():
        return None
    for c in json.loads(path.read_text())["comparisons"]:
        if {c["a"], c["b"]} == {causal_arm, bidir_arm}:
            return c["verdict"]
    return None


def _overall(checks_: list[dict], mask_verdict: str | None) -> str:
    maths, low_rank = checks_[0]["verdict"], next((c["verdict"] for c in checks_[1:2]), "inconclusive")
    if maths == "contradicted" or low_rank == "contradicted":
        return "contradicted"
    if maths == "supported" and low_rank == "supported" and mask_verdict == "supported":
        return "supported"
    return "inconclusive"


def markdown(exp: Experiment, r: dict, causal_arm: str, bidir_arm: str, figures: list[str]) -> str:
    lines = [
        f"# {exp.name}: {exp.claim}", "", f"**Source.** {exp.source}", "",
        f"**Verdict: {r['verdict']}** (supported if every causal matrix is exactly full rank, the trained "
        f"bidirectional prefix blocks have a lower effective rank than the causal ones, and the `{exp.arms_from}` "
        f"experiment found no gain from the bidirectional mask (its verdict: {r['mask_verdict'] or 'not run yet'}); "
        "contradicted if either of the first two is; otherwise inconclusive).", "",
        f"Models: the `{exp.arms_from}` runs `{causal_arm}` (causal) and `{bidir_arm}` (bidirectional over the first "
        f"{r['prefix_len']} positions), seeds 0..{exp.seeds - 1}, trained and at initialisation (the same seed); "
        f"{r['windows']} validation windows of the training length; every matrix in float64.",
        "", "## Checks", "", "| check | delta per seed | mean (t-interval) | verdict |", "|---|---|---|---|",
    ]  # fmt: skip
    for c in r["checks"]:
        seeds = ", ".join(f"{d:+.2f}" for d in c.get("deltas", [])) or "-"
        interval = f"{c['mean']:+.2f} ({c['t_interval'][0]:+.2f}, {c['t_interval'][1]:+.2f})" if "mean" in c else "-"
        lines.append(f"| {c['name']} | {seeds} | {interval} | **{c['verdict']}**: {c['why']} |")
    lines += ["", "## Effective rank by layer (mean over heads, windows and seeds)", ""]
    lines += [
        "| model | layer | full | prefix block | target block | stable rank (full) | numerically full rank (full, "
        "n*eps) | relative residual |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in (causal_arm, bidir_arm):
        for state in ("trained", "untrained"):
            group = [m for m in r["models"] if m["arm"] == arm and m["state"] == state]
            for layer in group[0]["layers"]:
                res = np.mean([m["residual"][layer] for m in group])
                lines.append(
                    f"| {arm} {state} | {layer} | {_avg(group, layer, 'full/erank'):.1f} | "
                    f"{_avg(group, layer, 'prefix/erank'):.1f} | {_avg(group, layer, 'target/erank'):.1f} | "
                    f"{_avg(group, layer, 'full/stable_rank'):.2f} | "
                    f"{_avg(group, layer, 'full/numerically_full_rank_share'):.2f} | {res:.3f} |"
                )
    if "deep_untrained_residual" in r:
        deep = ", ".join(f"{v:.3f}" for v in r["deep_untrained_residual"].values())
        lines += ["", f"Relative residual (Dong et al.) by layer, untrained 12-layer {causal_arm} twin: {deep}."]
    syn = r["synthetic"]
    lines += ["", "Model-free control (Gaussian Q, K, n = 256, d = 32; effective rank by logit scale "
              + ", ".join(map(str, syn["scales"])) + "): causal " + ", ".join(f"{v:.0f}" for v in syn["causal"])
              + "; bidirectional " + ", ".join(f"{v:.1f}" for v in syn["bidirectional"]) + "."]  # fmt: skip
    lines += closing_sections(exp, figures)
    lines += [
        "",
        "## Reproduce",
        "",
        f"`moe-lm experiment {exp.name}` (runs `{exp.arms_from}` first if needed)",
    ]
    return "\n".join(lines) + "\n"


def _avg(group: list[dict], layer, key: str) -> float:
    """Mean over models of a layer's entry (a per-matrix summary's mean, or a share)."""
    values = [m["layers"][layer][key] for m in group]
    return float(np.mean([v["mean"] if isinstance(v, dict) else v for v in values]))


def draw(r: dict, causal_arm: str, bidir_arm: str, folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moe_lm.analysis.plots import save

    folder.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for arm, style in ((causal_arm, "-"), (bidir_arm, "--")):
        for state, color in (("trained", "C0"), ("untrained", "C1")):
            group = [m for m in r["models"] if m["arm"] == arm and m["state"] == state]
            layers = list(group[0]["layers"])
            for ax, block in zip(axes[:2], ("prefix", "full"), strict=True):
                y = [np.mean([m["layers"][la][f"{block}/erank"]["mean"] for m in group]) for la in layers]
                ax.plot(range(len(layers)), y, style, color=color, marker="o", label=f"{arm} {state}")
    for ax, block in zip(axes[:2], ("prefix block", "full matrix"), strict=True):
        ax.set_xlabel("layer")
        ax.set_ylabel(f"effective rank, {block}")
        ax.legend(fontsize=7)
    syn = r["synthetic"]
    axes[2].plot(syn["scales"], syn["causal"], marker="o", label="causal")
    axes[2].plot(syn["scales"], syn["bidirectional"], marker="o", label="bidirectional")
    axes[2].set_xlabel("logit scale (Gaussian Q, K; n = 256, d = 32)")
    axes[2].set_ylabel("effective rank")
    axes[2].legend()
    save(fig, folder / "erank.png")
    return [str(folder / "erank.png")]
