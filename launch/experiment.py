"""Run an experiment: every arm x seed (cached), the whole-validation-split evaluation, report.md with a verdict.

    python launch/experiment.py moe-dense                 # configs/experiments/moe-dense.yaml, 3 seeds
    python launch/experiment.py balance --seeds 5 --steps 1000
    python launch/experiment.py moe-dense --preset gpu    # the definition's GPU-sized variant
    python launch/experiment.py my_experiment.yaml        # your own definition (see configs/experiments/)
    python launch/experiment.py --list

Runs go one at a time (single-process `launch/train.py`), each in runs/exp/<config hash> (--runs), so finished runs
are skipped and identical arms are shared between experiments. The report goes to runs/exp/reports/NAME (--out).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from moe_lm.cli import fail, run
from moe_lm.config import ConfigError
from moe_lm.experiments.rank_probe import run_rank_probe
from moe_lm.experiments.report import write_report
from moe_lm.experiments.runner import run_experiment
from moe_lm.experiments.spec import EXPERIMENTS_DIR, load_experiment

PROBES = {"rank": run_rank_probe}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", nargs="?", help="an experiment in configs/experiments/, or a path to a definition")
    ap.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default: the definition's)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default: the definition's)")
    ap.add_argument("--preset", default=None, help="a named variant of the definition, e.g. gpu")
    ap.add_argument("--extended", action="store_true", help="also run the definition's extended arms")
    ap.add_argument("--runs", default="runs/exp", help="where runs are cached")
    ap.add_argument("--out", default=None, help="report folder (default: <runs>/reports/<name>)")
    ap.add_argument("--boot", type=int, default=2000, help="bootstrap draws")
    ap.add_argument("--list", action="store_true", help="list the defined experiments")
    args = ap.parse_args()
    if args.list or not args.name:
        for path in sorted(EXPERIMENTS_DIR.glob("*.yaml")):
            exp = load_experiment(str(path))
            what = f"{len(exp.arms)} arms x {exp.seeds} seeds x {exp.steps} steps"
            if exp.probe:
                what = f"a probe of {exp.arms_from}'s {', '.join(exp.probe_arms)}"
            print(f"{exp.name:10s} {what}: {exp.claim}")
        return
    try:
        exp = load_experiment(args.name, args.preset, args.extended)
    except ConfigError as e:
        fail(str(e))
    if args.seeds is not None:
        exp = dataclasses.replace(exp, seeds=args.seeds)
    if args.steps is not None:
        exp = dataclasses.replace(exp, steps=args.steps)
    out = Path(args.out or Path(args.runs) / "reports" / (exp.name + (f"-{args.preset}" if args.preset else "")))
    print(f"{exp.name}: {exp.claim}\n{len(exp.arms)} arms x {exp.seeds} seeds x {exp.steps} steps; runs in {args.runs}")
    t0 = time.perf_counter()
    if exp.probe:  # the runs it probes are another experiment's arms (trained here if not cached)
        exp_runs = dataclasses.replace(exp, arms={a: exp.arms[a] for a in exp.probe_arms}, measures=[])
    else:
        exp_runs = exp
    try:
        runs = run_experiment(exp_runs, Path(args.runs))
    except (ConfigError, RuntimeError) as e:
        fail(str(e))
    if exp.probe:
        results = PROBES[exp.probe](exp, runs, out)
        print(f"verdict: {results['verdict']}")
        for c in results["checks"]:
            print(f"  {c['name']}: {c['verdict']} ({c['why']})")
        print(f"report: {out / 'report.md'} ({time.perf_counter() - t0:.0f} s)")
        return
    results = write_report(exp, runs, out, args.boot)
    print(f"verdict: {results['verdict']}")
    for c in results["comparisons"]:
        lo, hi = c["t_interval"]
        judged = c["verdict"] if c["role"] == "claim" else "context, not judged"
        print(f"  {c['name']} ({c['metric']}): {c['mean']:+.4f} ({lo:+.4f}, {hi:+.4f}) -> {judged}")
    print(f"report: {out / 'report.md'} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    run(main)
