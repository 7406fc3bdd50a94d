"""An experiment's figures: validation loss over training on the scored labels (against tokens, FLOPs and measured
training time), the per-domain deltas of the loss comparisons, the delta by distance from a prefix boundary, and with
routing measured, MaxVio_batch over steps and the relative expert load per domain (DeepSeek-V3's Fig. 9)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moe_lm.experiments.arm_data import ArmData
from moe_lm.experiments.curves import eval_curve, rows, scored_loss_key
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
    if "routing" in exp.measures:
        written.append(_draw_maxvio(by_arm, folder / "maxvio_batch.png"))
        written.append(_draw_relative_load(by_arm, domains, folder / "relative_load.png"))
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


def _draw_maxvio(by_arm: dict[str, ArmData], path: Path) -> Path:
    import matplotlib.pyplot as plt

    from moe_lm.analysis.plots import save

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, data in by_arm.items():
        curves = []
        for r in data.runs:
            train = rows(r.folder, "train")
            curves.append([np.mean([v for k, v in row.items() if k.startswith("maxvio/")]) for row in train])
        n = min(len(c) for c in curves)
        steps = [row["step"] for row in rows(data.runs[0].folder, "train")][:n]
        ax.plot(steps, np.mean([c[:n] for c in curves], 0), label=arm)
    ax.set_xlabel("step")
    ax.set_ylabel("MaxVio_batch (mean over MoE layers and seeds)")
    ax.set_yscale("log")
    ax.legend()
    save(fig, path)
    return path


def _draw_relative_load(by_arm: dict[str, ArmData], domains: list[str], path: Path) -> Path:
    """Per arm (rows) and MoE layer (columns): each domain's load on each expert relative to a uniform share
    (token-slots / (the domain's token-slots / experts)), summed over seeds, on the whole validation split."""
    import matplotlib.pyplot as plt

    from moe_lm.analysis.plots import save

    loads = {arm: relative_load(data) for arm, data in by_arm.items()}
    n_layers = max(v.shape[0] for v in loads.values())
    fig, axes = plt.subplots(len(loads), n_layers, figsize=(3.2 * n_layers + 1, 1.6 * len(loads) + 1), squeeze=False)
    top = max(float(v.max()) for v in loads.values())
    for row, (arm, load) in enumerate(loads.items()):
        for j in range(n_layers):
            image = axes[row, j].imshow(load[j], vmin=0, vmax=top, cmap="viridis", aspect="auto")
            axes[row, j].set_yticks(range(len(domains)), domains if j == 0 else [""] * len(domains), fontsize=7)
            axes[row, j].set_title(f"{arm}, MoE layer {j + 1}", fontsize=8)
            axes[row, j].set_xlabel("expert", fontsize=7)
    fig.colorbar(image, ax=axes, label="load / uniform share")
    save(fig, path)
    return path


def relative_load(data: ArmData) -> np.ndarray:
    """[MoE layer, domain, expert]: the domain's token-slots on the expert over its uniform share (1 = balanced)."""
    counts = sum(_by_domain(a["expert_counts"], a["domain"]) for a in data.arrays)
    return counts / (counts.sum(-1, keepdims=True) / counts.shape[-1])


def _by_domain(expert_counts: np.ndarray, domain: np.ndarray) -> np.ndarray:
    """[documents, layers, experts] -> [layers, domains, experts]."""
    out = np.zeros((expert_counts.shape[1], int(domain.max()) + 1, expert_counts.shape[2]))
    np.add.at(out, (slice(None), domain), expert_counts.transpose(1, 0, 2))
    return out
