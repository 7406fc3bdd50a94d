"""The table of experiment results that the README shows, generated from committed reports (docs/results/NAME/
results.json), never transcribed by hand: per experiment its verdict, each judged comparison with its seed-paired
mean and 95 % t-interval, and the command that gives the runs again. `moe-lm experiment --table docs/results`."""

from __future__ import annotations

import json
from pathlib import Path

from moe_lm.errors import UserError


def load_results(folder: Path) -> list[dict]:
    """Every NAME/results.json under `folder`, by name; an exploratory report is refused (it has no verdict)."""
    paths = sorted(Path(folder).glob("*/results.json"))
    if not paths:
        raise UserError(f"no */results.json under {folder}: write reports there (moe-lm experiment NAME --out ...)")
    results = []
    for path in paths:
        r = json.loads(path.read_text())
        if r.get("exploratory"):
            raise UserError(f"{path} is exploratory ({r['exploratory']}): only declared designs go in the table")
        results.append(r)
    return results


def results_table(folder: Path) -> str:
    """One row per shipped definition: its committed result, or a row saying it has not been run under the
    current rules (nothing is carried over from older runs)."""
    from moe_lm.experiments.spec import EXPERIMENTS_DIR, load_experiment

    lines = ["| experiment | claim | judged (a - b in the metric's unit: mean, 95 % t-interval over seeds) | verdict | "
             "command |",
             "|---|---|---|---|---|"]  # fmt: skip
    results = {r["experiment"]: r for r in load_results(folder)}
    for name in sorted({p.stem for p in EXPERIMENTS_DIR.glob("*.yaml")} | set(results)):
        r = results.get(name)
        if r is None:
            claim = load_experiment(name).claim
            lines.append(f"| {name} | {claim} | - | not run under the current rules yet | `moe-lm experiment {name}` |")
            continue
        judged = "; ".join(_judged(r)) or "-"
        lines.append(f"| {r['experiment']} | {r['claim']} | {judged} | **{r['verdict']}** | `{_command(r)}` |")
    return "\n".join(lines) + "\n"


def _judged(r: dict) -> list[str]:
    """Each judged row: a comparison (claim or premise) or a probe's check."""
    out = []
    for c in r.get("comparisons", []):
        if c["role"] in ("claim", "premise"):
            lo, hi = c["t_interval"]
            rel = f", {c['relative_percent']:+.1f} %" if c["metric"] == "loss" and c.get("relative_percent") else ""
            role = "premise: " if c["role"] == "premise" else ""
            out.append(f"{role}{c['name']}: {c['mean']:+.3f} ({lo:+.3f}, {hi:+.3f}){rel} → {c['verdict']}")
    for c in r.get("checks", []):
        if c["role"] == "claim":
            interval = (
                f": {c['mean']:+.2f} ({c['t_interval'][0]:+.2f}, {c['t_interval'][1]:+.2f})" if "mean" in c else ""
            )
            out.append(f"{c['name']}{interval} → {c['verdict']}")
    if r.get("mask_comparison"):
        out.append(f"mask effect on the probed runs → {r['mask_comparison']['verdict']}")
    return out


def _command(r: dict) -> str:
    return r.get("command") or f"moe-lm experiment {r['experiment']}"
