"""`moe-lm prune --check`: its flags and its run (moe_lm/pruning/check.py), apart from prune's own.

moe-lm prune --run runs/e16 --check --sparsities 0.125 0.25 0.5 --out analysis/e16-prune-check
moe-lm prune --run runs/e16 --check --keeps 12 8 --criteria reap frequency random --out analysis/check
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_lm.analysis.subjects import KINDS
from moe_lm.checkpoint.format import parse_run
from moe_lm.cli import output_folder
from moe_lm.cli.subject import check_subject, documents_request, subject_request
from moe_lm.errors import UserError
from moe_lm.flags import default_of, from_flags
from moe_lm.pruning.check import CHECK_CRITERIA, CHECK_FILES, CheckRequest, check_criteria, check_sparsities


def add_check_arguments(ap: argparse.ArgumentParser, how_many) -> None:
    """--check and its flags; `how_many`: prune's --sparsity/--keep group, which --sparsities/--keeps join."""
    ap.add_argument("--check", action="store_true", help="write no pruned run: check each of --criteria at each of "
                    "--sparsities on the run's validation split (held out; calibration: the training split, --data or "
                    "--trace) against the unpruned model, into --out (check.json, check.md, check.png)")  # fmt: skip
    how_many.add_argument("--sparsities", type=float, nargs="+", metavar="F", help="--check: the sparsities checked")
    how_many.add_argument("--keeps", type=int, nargs="+", metavar="N", help="--check: the kept counts checked")
    ap.add_argument("--criteria", nargs="+", metavar="NAME", help="--check: the criteria checked (default: "
                    f"{' '.join(CHECK_CRITERIA)}; ablation's scores: the others' reference)")  # fmt: skip
    ap.add_argument("--random-seeds", type=int, default=default_of(CheckRequest, "random_seeds"), metavar="N",
                    help="--check: the seeds of the random control (--seed, --seed + 1, ...)")  # fmt: skip
    ap.add_argument("--held-out-tokens", type=int, default=default_of(CheckRequest, "held_out_tokens"), metavar="N",
                    help="--check: validation-split tokens scored, spread equally over the domains")  # fmt: skip


def checking(args: argparse.Namespace) -> bool:
    """Whether prune is asked for the check; a UserError for a check's flag without --check."""
    if args.check:
        return True
    given = [flag for flag, value in (("--sparsities", args.sparsities), ("--keeps", args.keeps),
                                      ("--criteria", args.criteria)) if value]  # fmt: skip
    if given:
        raise UserError(f"{given[0]} is --check's: add --check (or give --sparsity / --keep and --criterion to write "
                        "one pruned run)")  # fmt: skip
    return False


def run_check(args: argparse.Namespace) -> None:
    if not getattr(args, "run", None):
        raise UserError("--check takes a moe-lm run (--run RUN): its validation split is the held-out text")
    for flag, value in (("--max-tokens", args.max_tokens), ("--held-out-tokens", args.held_out_tokens),
                        ("--batch-size", args.batch_size), ("--random-seeds", args.random_seeds)):  # fmt: skip
        if value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    criteria = check_criteria(args.criteria or CHECK_CRITERIA)
    sparsities = args.sparsities or ([args.sparsity] if args.sparsity is not None else None)
    keeps = args.keeps or ([args.keep] if args.keep is not None else None)
    if sparsities:
        check_sparsities(sparsities)
    if args.trace and args.data:
        raise UserError("--trace holds the calibration documents already; leave out --data (or --trace, to record "
                        "them from --data)")  # fmt: skip
    if args.trace and not (args.trace / "meta.json").is_file():
        raise UserError(f"--trace {args.trace}: not a recorded trace (no meta.json); give analyze's trace/ folder")
    source, out = parse_run(args.run).run.resolve(), Path(args.out).resolve()
    if out == source or out in source.parents:
        raise UserError(f"--out {args.out}: is the source run or holds it; give a new folder")
    folder = output_folder(args, "prune-check")
    kinds = [KINDS["run"]]
    settings = check_subject(args, kinds)
    from moe_lm.pruning.check import check_prune

    with folder.staged() as staging:
        record = check_prune(from_flags(
            CheckRequest, args, subject=subject_request(args, kinds, settings), out=staging, criteria=criteria,
            sparsities=tuple(sparsities) if sparsities else None, keeps=tuple(keeps) if keeps else None,
            documents=documents_request(args), domains=tuple(args.domains) if args.domains else None,
            n_boot=default_of(CheckRequest, "n_boot"),
        ))  # fmt: skip
    best = record["tracks_ablation_best"]
    print(f"wrote {', '.join(str(folder.path / f) for f in CHECK_FILES)}"
          + (f" (tracks ablation best: {best})" if best else ""))  # fmt: skip
