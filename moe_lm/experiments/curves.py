"""What a run's step rows (metrics.jsonl) say about its training: validation curves on the experiment's scored
labels against tokens, FLOPs and measured training time, and the train-validation gap.

Training time is the optimizer steps' own time (`train_seconds` in the train rows: start-up, evaluations and
checkpoints excluded), so arms compare on what their steps cost, not on how busy the host was between them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moe_lm.experiments.runner import Run
from moe_lm.experiments.spec import Experiment

GAP_TAIL = 0.1  # the train loss of the gap: the mean over the last 10 % of the steps


def rows(folder: Path, kind: str) -> list[dict]:
    path = Path(folder) / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == kind]


def scored_loss_key(exp: Experiment) -> str:
    """The evaluation rows' loss on the labels the experiment scores: `loss_scored` (window positions >= score_from)
    when it scores a suffix, else `loss` (every arm's own next-token or masked-token labels, the same labels)."""
    return "loss_scored" if exp.score_from > 1 else "loss"


def eval_curve(run: Run, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, validation loss, training seconds at each step) of the run's evaluations during training."""
    evals = [r for r in rows(run.folder, "eval") if key in r]
    train = rows(run.folder, "train")
    steps = np.array([r["step"] for r in evals], dtype=float)
    at = np.array([0.0] + [r["step"] for r in train]), np.array([0.0] + [r.get("train_seconds", np.nan) for r in train])
    return steps, np.array([r[key] for r in evals]), np.interp(steps, *at)


def train_seconds(run: Run) -> float | None:
    """The run's optimizer steps' measured time (the last train row's running sum)."""
    train = rows(run.folder, "train")
    value = train[-1].get("train_seconds") if train else None
    return float(value) if value is not None and np.isfinite(value) else None


def train_validation_gap(run: Run) -> dict:
    """The training loss over the last GAP_TAIL of the steps (each batch scored before its update) against the last
    evaluation during training on the same labels (the run's objective), its per-domain losses weighted by the
    training split's domain shares of tokens: evaluation windows weigh every domain alike, training batches by their
    tokens, and that difference alone would open a gap. Under one epoch every training batch is new, so the gap is
    the two splits' difference plus noise; past it, memorisation shows here."""
    train, evals = rows(run.folder, "train"), rows(run.folder, "eval")
    last = train[-1]["step"]
    tail = [r["loss"] for r in train if r["step"] > (1 - GAP_TAIL) * last]
    shares = training_domain_shares(run.cfg.data.out_dir)
    validation = sum(share * evals[-1][f"loss/{domain}"] for domain, share in shares.items())
    out = {"train_loss": float(np.mean(tail)), "validation_loss": float(validation)}
    out["gap"] = out["validation_loss"] - out["train_loss"]
    out["tokens_per_s"] = float(np.median([r["tokens_per_s"] for r in train]))
    return out


def training_domain_shares(data_dir: str | Path) -> dict[str, float]:
    """Each domain's share of the training split's tokens (the prepared folder's manifest)."""
    domains = json.loads((Path(data_dir) / "manifest.json").read_text())["domains"]
    tokens = {d: v["tokens"]["train"] for d, v in domains.items()}
    return {d: n / sum(tokens.values()) for d, n in tokens.items()}
