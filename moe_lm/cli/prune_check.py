"""`moe-lm prune --check`: its flags and its run (moe_lm/pruning/check.py), apart from prune's own.

moe-lm prune --run runs/e16 --check --sparsities 0.125 0.25 0.5 --out analysis/e16-prune-check
moe-lm prune --run runs/e16 --check --keeps 12 8 --criteria reap frequency random --out analysis/check
moe-lm prune --hf qwen3moe --check --data train.jsonl --held-out-data val.jsonl --sparsities 0.25 0.5 --out check
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_lm.analysis.documents import Documents
from moe_lm.analysis.subjects import KINDS
from moe_lm.checkpoint.format import parse_run
from moe_lm.cli import output_folder
from moe_lm.cli.subject import check_subject, documents_request, subject_request
from moe_lm.errors import UserError
from moe_lm.flags import default_of, from_flags
from moe_lm.pruning.check import CHECK_CRITERIA, CHECK_FILES, CheckRequest, check_criteria, check_sparsities


def add_check_arguments(ap: argparse.ArgumentParser, how_many) -> None:
    """--check and its flags; `how_many`: prune's --sparsity/--keep group, which --sparsities/--keeps join."""
    ap.add_argument("--check", action="store_true", help="write no pruned model: check each of --criteria at each "
                    "of --sparsities on held-out text (a run's validation split, or --held-out-data; calibration: "
                    "--data, --trace or a run's training split) against the unpruned model, into --out (check.json, "
                    "check.md, check.png); of a run or a transformers folder")  # fmt: skip
    ap.add_argument("--held-out-data", nargs="+", metavar="SOURCE", help="--check: the held-out documents (as "
                    "--data: files, folders, parquet, hf:NAME, with --text-field and --domain-field); a transformers "
                    "folder needs them, a run's default is its validation split")  # fmt: skip
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
                                      ("--criteria", args.criteria), ("--held-out-data", args.held_out_data))
             if value]  # fmt: skip
    if given:
        raise UserError(f"{given[0]} is --check's: add --check (or give --sparsity / --keep and --criterion to write "
                        "one pruned run)")  # fmt: skip
    return False


def run_check(args: argparse.Namespace) -> None:
    kinds = [KINDS["run"], KINDS["hf"]]
    if not args.run and not args.hf:
        raise UserError("--check runs each pruned model: give a moe-lm run (--run) or a transformers folder (--hf); a "
                        "GGUF file is pruned with --sparsity or --keep and --criterion")  # fmt: skip
    if args.hf and not args.held_out_data:
        raise UserError("--check of a transformers folder needs --held-out-data: the documents each pruned model is "
                        "scored on (none of the calibration --data)")  # fmt: skip
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
    source, out = (parse_run(args.run).run if args.run else Path(args.hf)).resolve(), Path(args.out).resolve()
    if out == source or out in source.parents:
        raise UserError(f"--out {args.out}: is the source or holds it; give a new folder")
    settings = check_subject(args, kinds, documents_given=bool(args.trace))
    folder = output_folder(args, "prune-check")
    from moe_lm.pruning.check import check_prune

    with folder.staged() as staging:
        record = check_prune(from_flags(
            CheckRequest, args, subject=subject_request(args, kinds, settings), out=staging, criteria=criteria,
            sparsities=tuple(sparsities) if sparsities else None, keeps=tuple(keeps) if keeps else None,
            documents=documents_request(args), domains=tuple(args.domains) if args.domains else None,
            held_out=Documents(tuple(args.held_out_data or ()), args.text_field, args.domain_field),
            n_boot=default_of(CheckRequest, "n_boot"),
        ))  # fmt: skip
    best = record["tracks_ablation_best"]
    print(f"wrote {', '.join(str(folder.path / f) for f in CHECK_FILES)}"
          + (f" (tracks ablation best: {best})" if best else ""))  # fmt: skip
