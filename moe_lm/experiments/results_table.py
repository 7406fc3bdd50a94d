"""The table of experiment results that the README shows, generated from committed reports, never transcribed by
hand: per experiment the pilot (docs/results/NAME/results.json) and its confirmatory round
(docs/results/confirmatory/NAME/results.json) side by side, each with its seeds and steps, its verdict and every
judged comparison with its seed-paired mean and 95 % t-interval (a claim without a confirmatory round says why); for
a claim still open, what would close it (the seeds its last report's power estimate asks for, or a longer schedule).
`moe-lm experiment --table docs/results`."""

from __future__ import annotations

from pathlib import Path

from moe_lm.errors import UserError
from moe_lm.experiments.declaration import DECLARATIONS_DIR, load_declaration
from moe_lm.experiments.power import seeds_needed
from moe_lm.experiments.report_file import read_report


def load_results(folder: Path) -> list[dict]:
    """Every NAME/results.json under `folder`, by name; an exploratory report is refused (it has no verdict), and so
    is a file that is not an experiment report of this moe-lm (one line naming it)."""
    paths = sorted(Path(folder).glob("*/results.json"))
    if not paths:
        raise UserError(f"no */results.json under {folder}: write reports there (moe-lm experiment NAME --out ...)")
    results = []
    for path in paths:
        r = read_report(path)
        if r.get("exploratory"):
            raise UserError(f"{path} is exploratory ({r['exploratory']}): only declared designs go in the table")
        results.append(r)
    return results


def results_table(folder: Path) -> str:
    """One row per shipped definition: its committed pilot and confirmatory results, or a cell saying it has not
    been run under the current rules (nothing is carried over from older runs)."""
    from moe_lm.experiments.spec import EXPERIMENTS_DIR

    lines = ["| experiment | claim | pilot (a - b in the metric's unit: mean, 95 % t-interval over seeds) | "
             "confirmatory round (fresh seeds, declared before it ran) | still open: what would close it |",
             "|---|---|---|---|---|"]  # fmt: skip
    pilots = {r["experiment"]: r for r in load_results(folder)}
    confirming = Path(folder) / "confirmatory"
    confirmed = {r["experiment"]: r for r in load_results(confirming)} if confirming.is_dir() else {}
    for name in sorted({p.stem for p in EXPERIMENTS_DIR.glob("*.yaml")} | set(pilots)):
        pilot, confirm = pilots.get(name), confirmed.get(name)
        try:
            lines.append(_row(name, pilot, confirm))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:  # a field of another shape
            raise UserError(f"the reports of {name} under {folder} are not ones this moe-lm reads ({type(e).__name__}: "
                            f"{e}); move them out of the results folder, or write them again") from None  # fmt: skip
    return "\n".join(lines) + "\n"


def _row(name: str, pilot: dict | None, confirm: dict | None) -> str:
    from moe_lm.experiments.spec import load_experiment

    claim = pilot["claim"] if pilot else load_experiment(name).claim
    cells = [_cell(pilot, f"moe-lm experiment {name}"), _cell(confirm, f"moe-lm experiment {name} --confirm")]
    if confirm is None and (DECLARATIONS_DIR / f"{name}.yaml").is_file():
        cells[1] = _declared(name)
    elif confirm is None and pilot is not None:
        cells[1] = _undeclared(name, pilot)
    return f"| {name} | {claim} | {cells[0]} | {cells[1]} | {_open(confirm or pilot)} |"


def _cell(r: dict | None, command: str) -> str:
    if r is None:
        return f"not run under the current rules yet (`{command}`)"
    judged = "; ".join(_judged(r)) or "-"
    return f"**{r['verdict']}** ({len(_seeds(r))} seeds x {_steps(r)} steps): {judged} (`{_command(r)}`)"


def _declared(name: str) -> str:
    """A confirmatory round declared (and committed) but not yet reported."""
    d = load_declaration(name)
    where = d.path.relative_to(d.path.parents[3])  # moe_lm/configs/experiments/confirmatory/NAME.yaml
    return (f"declared, not yet reported: {d.seeds} seeds x {d.steps} steps from seed {d.first_seed} ({where}; "
            f"`moe-lm experiment {name} --confirm`)")  # fmt: skip


def _undeclared(name: str, pilot: dict) -> str:
    """Why a claim with a pilot has no confirmatory round (`--confirm` needs a declaration, so the cell must not
    suggest running it): a probe judges another experiment's runs; a decided pilot stands until someone declares a
    repetition; an open one either has no design up to 200 seeds here or waits for its declaration."""
    from moe_lm.experiments.spec import EXPERIMENTS_DIR, load_experiment

    exp = load_experiment(name) if (EXPERIMENTS_DIR / f"{name}.yaml").is_file() else None  # else: the user's own
    if exp is not None and exp.probe:
        return f"none of its own: it probes the runs of `{exp.arms_from}`"
    declare = f"`moe-lm experiment {name} --declare WHY` writes one from the pilot"
    if pilot["verdict"] != "inconclusive":
        return f"none declared: the pilot's verdict ({pilot['verdict']}) stands; {declare}"
    rows = _open_rows(pilot)
    if rows and all(seeds is None for _, seeds in rows):
        return "none declared: no design up to 200 seeds reaches a verdict at this schedule (last column)"
    return f"none declared yet: {declare}, then `--confirm` runs it"


def _seeds(r: dict) -> list[int]:
    """The seeds a report judged (a probe's: those of the runs it probed)."""
    for c in [*r.get("comparisons", []), r.get("mask_comparison") or {}]:
        if c.get("seeds"):
            return c["seeds"]
    return list(range(r.get("seeds", 0)))


def _steps(r: dict) -> int | str:
    """The steps of a report's runs (a probe records none: its definition takes the probed experiment's)."""
    from moe_lm.experiments.spec import EXPERIMENTS_DIR, load_experiment

    if r.get("steps"):
        return r["steps"]
    return load_experiment(r["experiment"]).steps if (EXPERIMENTS_DIR / f"{r['experiment']}.yaml").is_file() else "?"


def _open(r: dict | None) -> str:
    """For each judged comparison of the newest report that is still inconclusive: the seeds a design at its
    schedule needs (its power estimate), or that none up to 200 reaches a verdict there."""
    if r is None or r["verdict"] != "inconclusive":  # decided (supported, contradicted, premise not met)
        return "-"
    out = []
    for name, seeds in _open_rows(r):
        if seeds:
            out.append(f"{name}: {seeds} seeds at {_steps(r)} steps")
        else:
            out.append(f"{name}: no design up to 200 seeds at {_steps(r)} steps; a longer schedule or the GPU "
                       "preset (--preset gpu)")  # fmt: skip
    return "; ".join(out) or "-"


def _open_rows(r: dict) -> list[tuple[str, int | None]]:
    """Each judged comparison still inconclusive, with the seeds its power estimate asks for (None: no design up to
    200)."""
    rows = []
    for c in r.get("comparisons", []):
        if c["role"] == "context" or c["verdict"] != "inconclusive" or len(c.get("deltas", [])) < 2:
            continue
        p = c.get("power") or seeds_needed(c["deltas"], c["expect"], c["margin"]).as_dict()  # reports before it
        rows.append((c["name"], p["seeds_needed"]))
    return rows


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
