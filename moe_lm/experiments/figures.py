"""An experiment's figures: validation loss over training on the scored labels (against tokens, FLOPs and measured
training time), the per-domain deltas of the loss comparisons, the delta by distance from a prefix boundary, and the
figures of the measures it asks for (measures.py: with routing, MaxVio_batch over steps and the relative expert load
per domain, DeepSeek-V3's Fig. 9)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moe_lm.experiments.arm_data import ArmData
from moe_lm.experiments.curves import eval_curve, scored_loss_key
from moe_lm.experiments.measures import MEASURES
from moe_lm.experiments.spec import Experiment
from moe_lm.model import train_flops_per_token


def draw(exp: Experiment, by_arm: dict[str, ArmData], comparisons: list[dict], domains: list[str], folder: Path):
    """The figures (see the module docstring) into `folder`. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    folder.mkdir(parents=True, exist_ok=True)
    written = [_draw_curves(exp, by_arm, folder / "curves.png")]
    loss_cmp = [c for c in comparisons if "by_domain" in c]
    if loss_cmp:
        written.append(_draw_deltas(loss_cmp, domains, folder / "deltas.png"))
    if exp.score_from > 1 and loss_cmp:
        written.append(_draw_delta_by_distance(exp, by_arm, loss_cmp, folder / "delta_by_distance.png"))
    for name in exp.measures:
        written += MEASURES[name].figures(by_arm, domains, folder)
    return [str(path) for path in written]


def _draw_curves(exp: Experiment, by_arm: dict[str, ArmData], path: Path) -> Path:
    """Mean over seeds with a min-max band, against training tokens, FLOPs and measured training time; every arm on
    the labels the experiment scores."""
    import matplotlib.pyplot as plt

    from moe_lm.analysis.plots import save

    key = scored_loss_key(exp)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for arm, data in by_arm.items():
        curves = [eval_curve(r, key) for r in data.runs]
        steps = sorted(set.intersection(*(set(c[0].tolist()) for c in curves)))
        if not steps:
            continue
        pick = [np.isin(c[0], steps) for c in curves]
        loss = np.array([c[1][p] for c, p in zip(curves, pick, strict=True)])
        seconds = np.array([c[2][p] for c, p in zip(curves, pick, strict=True)]).mean(0)
        cfg = data.runs[0].cfg
        t = cfg.train
        tokens = np.array(steps) * cfg.global_batch() * t.seq_len  # one process
        flops = tokens * train_flops_per_token(cfg.model, t.seq_len, cfg.objective.prefix_len)
        for ax, x in zip(axes, (tokens, flops, seconds), strict=True):
            ax.plot(x, loss.mean(0), marker="o", label=arm)
            ax.fill_between(x, loss.min(0), loss.max(0), alpha=0.2)
    what = f"labels at window positions >= {exp.score_from}" if key == "loss_scored" else "the scored labels"
    for ax, label in zip(
        axes, ("training tokens", "training FLOPs", "training time, s (optimizer steps)"), strict=True
    ):
        ax.set_xlabel(label)
        ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 3))
        ax.set_ylabel(f"validation loss, {what}")
        ax.legend()
    fig.suptitle(f"{exp.name}: mean over seeds, band = min-max (validation windows of the training cadence)")
    save(fig, path)
    return path


def _draw_deltas(loss_cmp: list[dict], domains: list[str], path: Path) -> Path:
    import matplotlib.pyplot as plt

    from moe_lm.analysis.plots import save

    # the comparisons' labels are sentences: the legend goes below the axes, where it covers no bar
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(domains) * len(loss_cmp)), 4 + 0.25 * len(loss_cmp)),
                           layout="constrained")  # fmt: skip
    width = 0.8 / len(loss_cmp)
    for i, c in enumerate(loss_cmp):
        x = np.arange(len(domains)) + i * width
        means = [c["by_domain"].get(d, {}).get("mean", np.nan) for d in range(len(domains))]
        lo = [c["by_domain"].get(d, {}).get("t_interval", [np.nan] * 2)[0] for d in range(len(domains))]
        hi = [c["by_domain"].get(d, {}).get("t_interval", [np.nan] * 2)[1] for d in range(len(domains))]
        err = np.array([np.subtract(means, lo), np.subtract(hi, means)])
        err = np.where(np.isfinite(err), err, 0)
        ax.bar(x, means, width, yerr=err, capsize=3, label=c["name"])
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(domains)) + 0.4 - width / 2, domains)
    ax.set_ylabel("delta loss (a - b), 95 % t-interval over seeds")
    fig.legend(loc="outside lower center", fontsize="small")
    save(fig, path)
    return path


def _draw_delta_by_distance(exp: Experiment, by_arm: dict[str, ArmData], loss_cmp: list[dict], path: Path) -> Path:
    import matplotlib.pyplot as plt

    from moe_lm.analysis.plots import save

    fig, ax = plt.subplots(figsize=(8, 4 + 0.25 * len(loss_cmp)), layout="constrained")
    for c in loss_cmp:
        curves = []
        for s in range(len(c["deltas"])):
            pa, pb = (by_arm[arm].arrays[s] for arm in (c["a"], c["b"]))
            with np.errstate(invalid="ignore", divide="ignore"):
                curves.append(pa["position_nll"] / pa["position_count"] - pb["position_nll"] / pb["position_count"])
        # only the scored positions: those before score_from have no label in any seed (all NaN)
        first = exp.score_from - 1  # position j scores target t_{j+1}
        mean = np.nanmean(np.asarray(curves)[:, first:], 0)
        x = np.arange(len(mean))  # the target's distance from the boundary
        ax.plot(x, mean, label=c["name"])
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel("target's distance from the prefix boundary (tokens)")
    ax.set_ylabel("delta loss (a - b), mean over seeds")
    fig.legend(loc="outside lower center", fontsize="small")
    save(fig, path)
    return path
