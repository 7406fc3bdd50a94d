"""How many seeds a design needs: the power of an experiment's verdict rule, sized from a pilot's seed-paired deltas.

A pilot (a committed report) gives, per comparison, the mean and the standard deviation of its per-seed deltas. Taking
them as the truth, the per-seed delta of a new design is N(mean, sd^2) and its verdict follows the very rule the
report applies (stats.decide: the 95 % t-interval against 0 or the margin, every seed agreeing for lower/higher, the
90 % interval for equivalence). The probability that an n-seed design reaches a verdict, supported or contradicted,
is estimated by simulating 20,000 such designs (a fixed random seed: the same answer every time; its Monte Carlo
error is at most 0.004 at 80 %). `seeds_needed` is the smallest n whose probability reaches 80 %.

What it assumes: the pilot's mean and sd are the true ones. With 3 pilot seeds the sd is itself uncertain (a
one-sided 80 % upper bound is 2.1 times the estimate), so a design sized here may still end inconclusive; the
report says so beside each estimate. And the rule's "every seed agrees" clause for lower/higher is harder to
satisfy with more seeds when the effect is small against its spread (P(all n agree) = Phi(|mean| / sd)^n): then
no n reaches 80 %, and the estimate says so instead of growing without end.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_lm.errors import UserError
from moe_lm.experiments import stats
from moe_lm.experiments.report_file import read_report

TARGET = 0.8  # the probability of a verdict a design is sized for
SIMULATIONS = 20_000
MOST_SEEDS = 200  # the largest design considered


@dataclass(frozen=True)
class Power:
    """The seeds a design needs for a verdict with probability TARGET, from a pilot's mean and sd."""

    pilot_seeds: int
    mean: float
    sd: float
    seeds: int | None  # None: no design up to MOST_SEEDS seeds reaches TARGET
    p_supported: float  # at `seeds` (or at the best n when none reaches TARGET)
    p_contradicted: float
    best_seeds: int  # the n with the highest probability of a verdict (= seeds when one reaches TARGET)

    @property
    def p_verdict(self) -> float:
        return self.p_supported + self.p_contradicted

    def as_dict(self) -> dict:
        return {"pilot_seeds": self.pilot_seeds, "mean": self.mean, "sd": self.sd, "seeds_needed": self.seeds,
                "target": TARGET, "p_supported": self.p_supported, "p_contradicted": self.p_contradicted,
                "best_seeds": self.best_seeds}  # fmt: skip


def verdict_probabilities(
    mean: float, sd: float, n: int, expect: str, margin: float = 0.0, sims: int = SIMULATIONS, seed: int = 0
) -> tuple[float, float]:
    """(P(supported), P(contradicted)) of an n-seed design whose per-seed deltas are N(mean, sd^2), under the rule
    `expect` (with `margin`), by simulation."""
    if n < 2:
        return 0.0, 0.0  # one seed: the interval is unbounded
    x = np.random.default_rng([seed, n]).normal(mean, sd, (sims, n))
    m, s = x.mean(1), x.std(1, ddof=1)
    half95 = stats.t_quantile(n - 1, 0.975) * s / math.sqrt(n)
    half90 = stats.t_quantile(n - 1, 0.95) * s / math.sqrt(n)
    supported, contradicted = stats.decide(
        m - half95, m + half95, m - half90, m + half90, (x < 0).all(1), (x > 0).all(1), expect, margin
    )
    return float(supported.mean()), float(contradicted.mean())


def seeds_needed(deltas: list[float], expect: str, margin: float = 0.0) -> Power:
    """The smallest design (seeds) whose verdict is reached with probability TARGET, taking the pilot's per-seed
    `deltas` (their mean and sd) as true."""
    d = np.asarray(deltas, dtype=float)
    mean, sd = float(d.mean()), float(d.std(ddof=1)) if len(d) > 1 else math.nan
    if not math.isfinite(sd):
        raise ValueError(f"a pilot of {len(d)} seed gives no spread to size a design from")
    probability = {}

    def at(n: int) -> tuple[float, float]:
        if n not in probability:
            probability[n] = verdict_probabilities(mean, sd, n, expect, margin)
        return probability[n]

    previous = 1
    for n in GRID:
        if sum(at(n)) >= TARGET:  # the first grid point that reaches it; the smallest n between the two before it
            lo, hi = previous, n
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if sum(at(mid)) >= TARGET else (mid, hi)
            return Power(len(d), mean, sd, hi, *at(hi), hi)
        previous = n
    best = max(probability, key=lambda n: sum(probability[n]))
    return Power(len(d), mean, sd, None, *at(best), best)


# the designs tried (then bisected between two of them): dense where designs are affordable, sparse beyond
GRID = [*range(2, 11), 12, 15, 20, 25, 30, 40, 50, 60, 80, 100, 125, 150, MOST_SEEDS]


def power_table(name: str, folder: Path) -> str:
    """`moe-lm experiment NAME --power`: for each report of experiment `name` under `folder` (the pilot, a longer
    schedule, a confirmatory round) and each judged comparison in it, the seeds a design needs, from its deltas.
    Nothing is trained."""
    reports = []
    for path in sorted(Path(folder).rglob("results.json")):
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # why not refused: another tool's file under the folder is none of this experiment's reports
        if isinstance(r, dict) and r.get("experiment") == name and r.get("comparisons"):
            reports.append((path.parent, read_report(path)))  # one of its reports: of a shape the table reads
    if not reports:
        raise UserError(f"no report of {name} under {folder} (a results.json with experiment: {name}); run it first")
    lines = [f"{name}: seeds for a verdict with {100 * TARGET:.0f} % probability, taking each report's seed-paired "
             "mean and sd as true (nothing trained)", "",
             "| comparison | report | seeds x steps | mean | sd | seeds for a verdict | P(supported) | "
             "P(contradicted) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for where, r in reports:
        kind = "confirmatory" if r.get("confirmatory") else "exploratory" if r.get("exploratory") else "pilot"
        for c in r["comparisons"]:
            if c["role"] == "context" or len(c["deltas"]) < 2:
                continue
            p = seeds_needed(c["deltas"], c["expect"], c["margin"])
            needed = str(p.seeds) if p.seeds else f"none up to {MOST_SEEDS} (best {p.best_seeds})"
            design = f"{len(c['deltas'])} x {r.get('steps', '?')}"
            lines.append(
                f"| {c['name']} | {where} ({kind}) | {design} | {p.mean:+.4f} | {p.sd:.4f} | "
                f"{needed} | {p.p_supported:.2f} | {p.p_contradicted:.2f} |"
            )
    return "\n".join(lines) + "\n"
