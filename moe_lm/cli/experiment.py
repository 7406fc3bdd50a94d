"""Run an experiment: every arm x seed (cached), the whole-validation-split evaluation, report.md with a verdict.

    moe-lm experiment --list                        # the definitions shipped with the package
    moe-lm experiment moe-dense                     # its arms x 3 seeds, then runs/exp/reports/moe-dense/report.md
    moe-lm experiment balance --seeds 5 --steps 1000  # exploratory: other seeds/steps than declared, no verdict
    moe-lm experiment moe-dense --preset gpu        # the definition's GPU-sized variant
    moe-lm experiment moe-dense --long              # its declared long design: 1000 steps, 5 seeds
    moe-lm experiment my_experiment.yaml            # your own definition (see docs/experiments.md)

Runs go one at a time (single-process training runs), each in <runs>/<key> (the whole config, the data's
fingerprint, the code's version), so finished runs are skipped and identical arms are shared between experiments.
The report goes to <runs>/reports/NAME (--out). The same as `python launch/experiment.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from moe_lm.cli import main_of
from moe_lm.cli.options import add_out
from moe_lm.errors import UserError, require
from moe_lm.output_folder import OutputFolder


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("name", nargs="?", help="an experiment shipped with the package (--list), or a definition file")
    ap.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default: the definition's)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default: the definition's)")
    ap.add_argument("--preset", default=None, help="a named variant of the definition, e.g. gpu")
    ap.add_argument("--long", action="store_true", help="the definition's declared long design (--preset long)")
    ap.add_argument("--extended", action="store_true", help="also run the definition's extended arms")
    ap.add_argument("--runs", default="runs/exp", metavar="DIR", help="where runs are cached")
    add_out(ap, "the report folder (default: <runs>/reports/<name>)", required=False)
    ap.add_argument("--boot", type=int, default=2000, help="bootstrap draws")
    ap.add_argument("--list", action="store_true", help="list the defined experiments")
    ap.add_argument("--table", metavar="DIR", help="print the results table of the reports under DIR (the README's)")
    ap.add_argument(
        "--power",
        action="store_true",
        help="print the seeds a design needs for a verdict, from the reports under --results (no training)",
    )
    ap.add_argument("--results", default="docs/results", metavar="DIR", help="where --power reads reports")
    ap.add_argument("--declare", metavar="WHY", help="write its confirmatory declaration, sized from its pilot under "
                    "--results, at --steps (default: the definition's); WHY: the schedule's reason")  # fmt: skip
    ap.add_argument("--confirm", action="store_true",
                    help="its declared confirmatory round (configs/experiments/confirmatory/)")  # fmt: skip


def run(args: argparse.Namespace) -> None:
    from moe_lm.experiments.spec import load_experiment

    if args.table:
        from moe_lm.experiments.results_table import results_table

        print(results_table(Path(args.table)), end="")
        return
    if args.list or not args.name:
        list_experiments()
        return
    if args.power:
        from moe_lm.experiments.power import power_table

        print(power_table(load_experiment(args.name).name, Path(args.results)), end="")
        return
    if args.declare:
        write_declaration(load_experiment(args.name), args)
        return
    if args.long:
        if args.preset not in (None, "long"):
            raise UserError(f"--long is --preset long; it cannot go with --preset {args.preset}")
        args.preset = "long"
    exp = load_experiment(args.name, args.preset, args.extended)
    require("matplotlib", "analysis", "moe-lm experiment (its report's figures)")
    if args.confirm:
        exp = declared(exp, args)
    deviations = [exp.exploratory] if exp.exploratory else []
    if args.seeds is not None and args.seeds != exp.seeds:
        deviations.append(f"--seeds {args.seeds} where the definition has {exp.seeds}")
        exp = dataclasses.replace(exp, seeds=args.seeds)
    if args.steps is not None and args.steps != exp.steps:
        deviations.append(f"--steps {args.steps} where the definition has {exp.steps}")
        exp = dataclasses.replace(exp, steps=args.steps)
    exp = dataclasses.replace(exp, exploratory="; ".join(deviations))
    suffix = "-confirmatory" if args.confirm else f"-{args.preset}" if args.preset else ""
    out = Path(args.out or Path(args.runs) / "reports" / (exp.name + suffix))
    report = OutputFolder(out, "experiment", force=args.force)  # why here: refused before hours of training
    print(f"{exp.name}: {exp.claim}\n{len(exp.arms)} arms x {exp.seeds} seeds x {exp.steps} steps; runs in {args.runs}")
    t0 = time.perf_counter()
    with report.staged() as folder:
        results = run_and_report(exp, Path(args.runs), folder, args.boot)
    print(f"verdict: {results['verdict']}")
    for c in results.get("checks", []):
        print(f"  {c['name']}: {c['verdict']} ({c['why']})")
    for c in results.get("comparisons", []):
        lo, hi = c["t_interval"]
        judged = {"claim": c["verdict"], "premise": f"premise {c['verdict']}"}.get(c["role"], "context, not judged")
        print(f"  {c['name']} ({c['metric']}): {c['mean']:+.4f} ({lo:+.4f}, {hi:+.4f}) -> {judged}")
    print(f"report: {out / 'report.md'} ({time.perf_counter() - t0:.0f} s)")


def write_declaration(exp, args: argparse.Namespace) -> None:
    """configs/experiments/confirmatory/NAME.yaml from the pilot's report (never over an existing declaration: once
    committed, a declaration stands)."""
    import json

    from moe_lm.experiments.declaration import DECLARATIONS_DIR, declare
    from moe_lm.experiments.spec import EXPERIMENTS_DIR

    pilot = Path(args.results) / exp.name / "results.json"
    if not pilot.is_file():
        raise UserError(f"--declare: no pilot report {pilot}; run and commit the pilot first")
    path = DECLARATIONS_DIR / f"{exp.name}.yaml"
    if path.exists():
        raise UserError(f"--declare: {path} exists; a declaration stands once written (remove it by hand to redo it)")
    text = declare(exp, EXPERIMENTS_DIR / f"{exp.name}.yaml", json.loads(pilot.read_text()), args.steps or exp.steps,
                   args.declare)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}:\n{text}")


def declared(exp, args: argparse.Namespace):
    """`exp` as its confirmatory declaration has it; anything on the command line that would change it is refused."""
    from moe_lm.experiments.declaration import confirmatory, load_declaration
    from moe_lm.experiments.spec import EXPERIMENTS_DIR

    changed = [flag for flag, value in (("--seeds", args.seeds), ("--steps", args.steps), ("--preset", args.preset),
               ("--extended", args.extended or None)) if value is not None]  # fmt: skip
    if changed:
        raise UserError(f"--confirm runs the declared design; {', '.join(changed)} would change it (drop them, or run "
                        "without --confirm: exploratory)")  # fmt: skip
    if exp.probe:
        raise UserError(f"--confirm: {exp.name} is a probe of another experiment's runs; confirm that experiment")
    return confirmatory(exp, EXPERIMENTS_DIR / f"{exp.name}.yaml", load_declaration(exp.name), Path(args.runs))


def run_and_report(exp, runs_root: Path, out: Path, boot: int) -> dict:
    """Train and evaluate the runs an experiment needs, then write its report (or its probe's)."""
    from moe_lm.experiments.measures import probe_function
    from moe_lm.experiments.report import write_report
    from moe_lm.experiments.runner import run_experiment

    if exp.probe:  # the runs it probes are another experiment's arms (trained here if not cached)
        runs = run_experiment(dataclasses.replace(exp, arms={a: exp.arms[a] for a in exp.probe_arms}, measures=[]),
                              runs_root)  # fmt: skip
        return probe_function(exp.probe)(exp, runs, out)
    return write_report(exp, run_experiment(exp, runs_root), out, boot)


def list_experiments() -> None:
    from moe_lm.experiments.spec import EXPERIMENTS_DIR, load_experiment

    for path in sorted(EXPERIMENTS_DIR.glob("*.yaml")):
        exp = load_experiment(str(path))
        what = f"{len(exp.arms)} arms x {exp.seeds} seeds x {exp.steps} steps"
        if exp.probe:
            what = f"a probe of {exp.arms_from}'s {', '.join(exp.probe_arms)}"
        print(f"{exp.name:10s} {what}: {exp.claim}")


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    main_of(sys.modules[__name__], prog, argv)


if __name__ == "__main__":
    main(prog="python -m moe_lm.cli.experiment")
