"""The `rank` experiment: attention-matrix rank of causal vs bidirectional (prefix) models, trained and untrained.

It probes the checkpoints of another experiment (mask: gpt-tgt is causal, unilm bidirectional over a 128-token
prefix; same parameters, labels, seeds) and, for each, the same architecture at its initialisation (the seed's
untrained twin). Per layer and head, on fixed validation windows: the full matrix, the prefix block (positions
< P: bidirectional vs lower-triangular) and the target block. Plus Dong et al.'s rank collapse of the hidden states
(also for an untrained 12-layer twin, where depth shows) and a model-free Gaussian control. Measures:
moe_lm/experiments/attention_probe.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from moe_lm.checkpoint.format import load_model
from moe_lm.experiments import stats
from moe_lm.experiments.arm_data import ArmData
from moe_lm.experiments.attention_probe import (
    attention_logits,
    attention_matrices,
    capture_attention,
    probe_windows,
    rank_metrics,
    relative_residual,
    synthetic_erank,
)
from moe_lm.experiments.report import closing_sections, command, common_inputs, compare
from moe_lm.experiments.runner import Run
from moe_lm.experiments.spec import Experiment
from moe_lm.model import Transformer, initial_model

BLOCKS = ("full", "prefix", "target")
LAYER_COLUMNS = ("full/erank", "prefix/erank", "target/erank", "logits_prefix/rank_eps", "logits_prefix/erank")


@torch.no_grad()
def probe_model(model: Transformer, windows: torch.Tensor, prefix_len: int, batch: int = 8) -> dict:
    """Per layer: per-head means of every rank measure over the windows, for each block, and of the prefix block's
    logits; the matrices' counts of (exactly, numerically) full rank; the hidden states' relative residual, the
    attention-only path's; and per window the prefix block's effective rank (mean over layers and heads)."""
    model.eval()
    bidirectional = model.cfg.attn_mask == "prefix"
    P = prefix_len
    acc: dict[int, dict[str, list]] = {}
    residual: dict[int, list] = {}
    attention_only: dict[int, list] = {}
    first_input: list[torch.Tensor] = []
    hooks = [
        block.register_forward_hook(lambda m, i, o, layer=layer: residual.setdefault(layer, []).append(
            relative_residual(o[0]).numpy()))
        for layer, block in enumerate(model.layers)
    ]  # fmt: skip
    hooks.append(model.layers[0].register_forward_pre_hook(lambda m, args: first_input.append(args[0].detach())))
    try:
        for chunk in windows.split(batch):
            store, first_input[:] = [], []
            with capture_attention(model, store):
                model(chunk[:, :-1], prefix_len=P if bidirectional else None)
            x = first_input[0].double()  # the attention-only path: X <- mean_h(A) X, layer after layer
            for layer, (q, k, _, mask, scale, gqa) in enumerate(store):
                A = attention_matrices(q, k, mask, scale, gqa)  # [B, H, S, S]
                parts = {"full": A, "prefix": A[..., :P, :P], "target": A[..., P:, P:]}
                parts["logits_prefix"] = attention_logits(q, k, scale, gqa)[..., :P, :P]
                for block, M in parts.items():
                    for name, value in rank_metrics(M).items():
                        acc.setdefault(layer, {}).setdefault(f"{block}/{name}", []).append(value.double().numpy())
                x = A.mean(1) @ x
                attention_only.setdefault(layer, []).append(relative_residual(x).numpy())
    finally:
        for h in hooks:
            h.remove()
    out = {"layers": {layer: _layer_summary(a, windows.shape[1] - 1, P) for layer, a in acc.items()}}
    out["residual"] = {layer: float(np.concatenate(v).mean()) for layer, v in residual.items()}
    out["attention_only_residual"] = {layer: float(np.concatenate(v).mean()) for layer, v in attention_only.items()}
    by_window = np.mean([np.concatenate(a["prefix/erank"]).mean(1) for a in acc.values()], axis=0)
    out["prefix_erank_by_window"] = by_window.tolist()
    return out


def _layer_summary(acc: dict[str, list], S: int, P: int) -> dict:
    entry = {}
    for key, values in acc.items():
        v = np.concatenate(values)  # [windows, heads]
        entry[key] = {"mean_by_head": v.mean(0).tolist(), "mean": float(v.mean()), "min": float(v.min())}
    for block, n in {"full": S, "prefix": P, "target": S - P}.items():
        entry[f"{block}/exactly_full_rank_share"] = float(
            np.mean(np.concatenate(acc[f"{block}/nonzero_diagonal"]) == n)
        )
        entry[f"{block}/numerically_full_rank_share"] = float(np.mean(np.concatenate(acc[f"{block}/rank_eps"]) == n))
        entry[f"{block}/full_rank_at_1e-6_share"] = float(np.mean(np.concatenate(acc[f"{block}/rank_1e-06"]) == n))
    return entry


def untrained_twin(cfg, **model_changes) -> Transformer:
    """The run's architecture at the initialisation training started from (the same seed)."""
    return initial_model(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model_changes))).eval()


def run_rank_probe(exp: Experiment, runs: list[Run], out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    P = exp.score_from
    causal_arm, bidir_arm = exp.probe_arms
    results = {"experiment": exp.name, "claim": exp.claim, "prefix_len": P, "windows": exp.windows, "models": [],
               "command": command(exp)}  # fmt: skip
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
    results["mask_comparison"] = mask_comparison(exp, runs)
    results["exploratory"] = exp.exploratory
    results["verdict"] = _overall(results["checks"], results["mask_comparison"], exp.exploratory)
    results["inputs"] = common_inputs(runs)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    figures = draw(results, causal_arm, bidir_arm, out / "figures")
    (out / "report.md").write_text(markdown(exp, results, causal_arm, bidir_arm, figures))
    return results


def _mean_over_layers(entry: dict, key: str) -> float:
    return float(np.mean([layer[key]["mean"] for layer in entry["layers"].values()]))


def checks(results: dict, causal_arm: str, bidir_arm: str) -> list[dict]:
    """The maths claim (exact rank: true by construction; numerical rank at n*eps: judged; at 1e-6: context) and
    the explanatory one (trained: judged; untrained: context), each with its seeds' deltas."""
    models = results["models"]
    causal = [layer for m in models if m["arm"] == causal_arm for layer in m["layers"].values()]

    def share(key: str) -> float:  # the smallest share over the causal models' layers and (causal) blocks
        return min(layer[f"{b}/{key}"] for layer in causal for b in BLOCKS)

    exact, numeric, at_1e6 = (
        share("exactly_full_rank_share"),
        share("numerically_full_rank_share"),
        share("full_rank_at_1e-6_share"),
    )
    out = [
        {"name": "every causal attention matrix is exactly full rank (its determinant is the product of its diagonal)",
         "role": "construction",
         "verdict": "true by construction" if exact == 1.0 else "contradicted (a diagonal entry underflowed)",
         "why": "softmax gives every attended position a positive weight and each position attends to itself; "
         f"checked: share of causal matrices with no zero diagonal entry {exact:.3f}"},
        {"name": "every causal attention matrix is numerically full rank (every singular value >= n * eps * s_1)",
         "role": "claim", "verdict": "supported" if numeric == 1.0 else "contradicted",
         "why": "share of causal matrices (full, prefix and target blocks) numerically full rank: at least "
         f"{numeric:.3f} per layer and block (a triangular matrix can be nonsingular and numerically singular)"},
        {"name": "every causal attention matrix keeps every singular value >= 1e-6 * s_1", "role": "context",
         "verdict": f"context ({'supported' if at_1e6 == 1.0 else 'contradicted'})",
         "why": f"share full rank at tau = 1e-6: at least {at_1e6:.3f} per layer and block"},
    ]  # fmt: skip
    for state in ("trained", "untrained"):
        row = _low_rank_row(models, state, causal_arm, bidir_arm)
        if row:
            out.append(row)
    return out


def _low_rank_row(models: list[dict], state: str, causal_arm: str, bidir_arm: str, n_boot: int = 2000) -> dict:
    """bidirectional - causal prefix-block effective rank per seed, its t-interval (judged when trained), and a
    bootstrap over the probe windows paired across seeds and arms (labelled, beside it)."""
    pairs = {}
    for m in models:
        if m["state"] == state and m["arm"] in (causal_arm, bidir_arm):
            pairs.setdefault(m["seed"], {})[m["arm"]] = m
    pairs = {s: p for s, p in sorted(pairs.items()) if len(p) == 2}
    if not pairs:
        return {}
    deltas = [_mean_over_layers(p[bidir_arm], "prefix/erank") - _mean_over_layers(p[causal_arm], "prefix/erank")
              for p in pairs.values()]  # fmt: skip
    mean, lo, hi = stats.t_interval(deltas)
    verdict, why = stats.verdict(deltas, lo, hi, "lower")
    by_window = np.array([np.subtract(p[bidir_arm]["prefix_erank_by_window"], p[causal_arm]["prefix_erank_by_window"])
                          for p in pairs.values()])  # fmt: skip
    draws = np.random.default_rng(0).integers(0, by_window.shape[1], (n_boot, by_window.shape[1]))
    boot = np.percentile(by_window[:, draws].mean(axis=(0, 2)), [2.5, 97.5]).tolist()
    return {
        "name": f"{state}: the bidirectional prefix block has a lower effective rank than the causal one "
        f"({bidir_arm} - {causal_arm}, mean over layers and heads)",
        "role": "claim" if state == "trained" else "context", "seeds": list(pairs), "deltas": deltas, "mean": mean,
        "t_interval": [lo, hi], "window_bootstrap": boot,
        "verdict": verdict if state == "trained" else f"context ({verdict})", "why": why,
    }  # fmt: skip


def mask_comparison(exp: Experiment, runs: list[Run], n_boot: int = 200) -> dict | None:
    """The source experiment's judged comparison of the probed arms, computed from the probed runs themselves (not
    from a report that may belong to other runs)."""
    c = next((c for c in exp.comparisons if {c.a, c.b} == set(exp.probe_arms) and c.role == "claim"), None)
    if c is None:
        return None
    by_arm = {arm: ArmData([r for r in runs if r.arm == arm]) for arm in (c.a, c.b)}
    return compare(c, by_arm[c.a], by_arm[c.b], n_boot)


def _overall(checks_: list[dict], mask: dict | None, exploratory: str = "") -> str:
    if exploratory:
        return "exploratory (no verdict)"
    maths = next(c["verdict"] for c in checks_ if c["role"] == "claim")
    low_rank = next((c["verdict"] for c in checks_ if c["role"] == "claim" and "deltas" in c), "inconclusive")
    if maths == "contradicted" or low_rank == "contradicted":
        return "contradicted"
    if maths == "supported" and low_rank == "supported" and mask is not None and mask["verdict"] == "supported":
        return "supported"
    return "inconclusive"


def markdown(exp: Experiment, r: dict, causal_arm: str, bidir_arm: str, figures: list[str]) -> str:
    mask = r["mask_comparison"]
    mask_line = (f"{mask['verdict']} ({mask['a']} - {mask['b']} loss {mask['mean']:+.4f}, t-interval "
                 f"{mask['t_interval'][0]:+.4f}, {mask['t_interval'][1]:+.4f}; computed from the probed runs)"
                 if mask else "no judged comparison of these arms")  # fmt: skip
    lines = [
        f"# {exp.name}: {exp.claim}", "", f"**Source.** {exp.source}", "",
        f"**Verdict: {r['verdict']}** (supported if every causal matrix is numerically full rank, the trained "
        f"bidirectional prefix blocks have a lower effective rank than the causal ones, and `{exp.arms_from}`'s "
        f"judged comparison of these very runs found no gain from the bidirectional mask: {mask_line}; "
        "contradicted if either of the first two is; otherwise inconclusive).", "",
    ]  # fmt: skip
    if r.get("exploratory"):
        lines += [f"**Exploratory**: {r['exploratory']}; no verdict.", ""]
    lines += [
        f"Models: the `{exp.arms_from}` runs `{causal_arm}` (causal) and `{bidir_arm}` (bidirectional over the first "
        f"{r['prefix_len']} positions), seeds 0..{exp.seeds - 1}, trained and at initialisation (the same seed); "
        f"{r['windows']} validation windows of the training length; every matrix in float64. Intervals: 95 % t over "
        "seeds (judged); beside it, labelled, a bootstrap over the probe windows paired across seeds and arms.",
        "", "## Checks", "", "| check | role | delta per seed | mean (t-interval) | window bootstrap | verdict |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for c in r["checks"]:
        seeds = ", ".join(f"{d:+.2f}" for d in c.get("deltas", [])) or "-"
        interval = f"{c['mean']:+.2f} ({c['t_interval'][0]:+.2f}, {c['t_interval'][1]:+.2f})" if "mean" in c else "-"
        boot = "({:+.2f}, {:+.2f})".format(*c["window_bootstrap"]) if "window_bootstrap" in c else "-"
        lines.append(f"| {c['name']} | {c['role']} | {seeds} | {interval} | {boot} | **{c['verdict']}**: {c['why']} |")
    lines += _layer_table(r, causal_arm, bidir_arm)
    if "deep_untrained_residual" in r:
        deep = ", ".join(f"{v:.3f}" for v in r["deep_untrained_residual"].values())
        lines += ["", f"Relative residual (Dong et al.) by layer, untrained 12-layer {causal_arm} twin: {deep}."]
    syn = r["synthetic"]
    lines += ["", "Model-free control (Gaussian Q, K, n = 256, d = 32; effective rank by logit scale "
              + ", ".join(map(str, syn["scales"])) + "): causal " + ", ".join(f"{v:.0f}" for v in syn["causal"])
              + "; bidirectional " + ", ".join(f"{v:.1f}" for v in syn["bidirectional"]) + "."]  # fmt: skip
    lines += closing_sections(exp, figures)
    lines += ["", "## Reproduce", "", f"`moe-lm experiment {exp.name}` (runs `{exp.arms_from}` first if needed)"]
    return "\n".join(lines) + "\n"


def _layer_table(r: dict, causal_arm: str, bidir_arm: str) -> list[str]:
    lines = ["", "## By layer (mean over heads, windows and seeds)", "",
             "| model | layer | erank full | erank prefix | erank target | logit rank prefix (n*eps) | erank logits "
             "prefix | stable rank (full) | numerically full rank (full) | relative residual | attention-only "
             "residual |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm in (causal_arm, bidir_arm):
        for state in ("trained", "untrained"):
            group = [m for m in r["models"] if m["arm"] == arm and m["state"] == state]
            for layer in group[0]["layers"]:
                res = np.mean([m["residual"][layer] for m in group])
                only = np.mean([m["attention_only_residual"][layer] for m in group])
                cells = [f"{_avg(group, layer, key):.1f}" for key in LAYER_COLUMNS]
                lines.append(
                    f"| {arm} {state} | {layer} | {' | '.join(cells)} | {_avg(group, layer, 'full/stable_rank'):.2f}"
                    f" | {_avg(group, layer, 'full/numerically_full_rank_share'):.2f} | {res:.3f} | {only:.3f} |"
                )
    return lines


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
