"""Prune routed experts: keep the most salient of each MoE layer and write the smaller model in the source's format.

    moe-lm prune --run runs/e16 --sparsity 0.5 --out runs/e16-pruned                  # REAP on the validation split
    moe-lm prune --run runs/e16 --keep 12 --criterion frequency --out runs/e16-f12
    moe-lm prune --run runs/e16 --sparsity 0.25 --data corpus/ --domains code --out runs/e16-code   # serve code
    moe-lm prune --run runs/e16 --sparsity 0.5 --trace analysis/e16/trace --out runs/e16-p50       # a trace again
    moe-lm prune --run runs/e16 --sparsity 0.25 --criterion ablation --max-tokens 5000 --out runs/e16-abl
    moe-lm prune --run runs/tour --sparsity 0.25 --ungroup --out runs/tour-p25     # 8 experts in 4 groups of 2
    moe-lm prune --hf path/to/DeepSeek-V3 --data corpus/ --criterion frequency --keep 128 --out dsv3-128   # FP8 too
    moe-lm prune --gguf model-Q4_K_M.gguf --data corpus/ --criterion gate-mass --sparsity 0.25 --out m-p25.gguf

Each MoE layer's routed experts are scored on calibration documents (--data, or the run's validation split, under
--max-tokens spread equally over the domains; or the tokens of a trace `moe-lm analyze` recorded, --trace), the
tokens of --domains only where given: reap (mean gate x output norm over the tokens routed to the expert),
frequency (tokens routed), gate-mass (sum of gates), ablation (the loss increase when the expert alone is removed:
the reference, one pass of the documents per expert) or random (seeded, the control). Every layer keeps the same
number, every expert group the same share (group-limited routing stays valid; --ungroup drops the groups where they
cannot); shared experts are never pruned.
Removing an expert is masking its router score before selection, group scores included: the pruned run's logits are
the source's under that mask. Writes a run into --out (never the source): checkpoints/<the source's tag>/ with the
kept experts only, the config with the new model.moe.n_routed_experts, prune.json (the plan: every expert's score,
the kept ids) and calibration_trace/ (when recorded here). --hf (a DeepseekV3/Glm4Moe/Qwen3Moe transformers folder, or
DeepSeek's FP8 release, streamed) and --gguf are recorded as `moe-lm analyze` records them and written as a new folder
or file of their own format, prune.json and the trace in the folder or beside the file (<out>.prune.json); reap needs
the experts' output norms, which moe-lm records from every kind (a transformers folder streamed from disk too), and
ablation a model held in memory (not a GGUF file, nor a folder streamed from disk). --check writes no pruned model:
each criterion at each sparsity is scored on held-out text against the unpruned model, for a run or a transformers
folder held in memory. docs/pruning.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from moe_lm.cli import main_of
from moe_lm.cli.options import add_out
from moe_lm.cli.prune_check import add_check_arguments, checking, run_check
from moe_lm.cli.subject import add_subject, check_subject, documents_request, prunable_kinds, subject_request
from moe_lm.errors import UserError
from moe_lm.flags import default_of, from_flags
from moe_lm.pruning.criteria import CRITERIA
from moe_lm.pruning.run import PruneRequest


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_subject(ap, prunable_kinds())
    add_out(ap, "the pruned model, in the source's format: a run folder, a transformers folder, a GGUF file (created; "
            "never the source)")  # fmt: skip
    ap.add_argument("--criterion", choices=CRITERIA, default=default_of(PruneRequest, "criterion"),
                    help="how each routed expert is scored")  # fmt: skip
    how_many = ap.add_mutually_exclusive_group(required=True)
    how_many.add_argument("--sparsity", type=float, metavar="F", help="the fraction of each layer's routed experts "
                          "removed (0 < F < 1)")  # fmt: skip
    how_many.add_argument("--keep", type=int, metavar="N", help="the routed experts each layer keeps")
    ap.add_argument("--domains", nargs="+", metavar="DOMAIN", help="score on these domains' documents only (the "
                    "domains the pruned model is to keep serving; default: all)")  # fmt: skip
    ap.add_argument("--trace", type=Path, help="score from this recorded trace of the source (moe-lm "
                    "analyze's trace/), its tokens the calibration documents")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=default_of(PruneRequest, "max_tokens"),
                    help="calibration tokens recorded, spread equally over the domains")  # fmt: skip
    ap.add_argument("--batch-size", type=int, default=default_of(PruneRequest, "batch_size"), metavar="N",
                    help="sequences per forward pass")  # fmt: skip
    ap.add_argument("--seed", type=int, default=default_of(PruneRequest, "seed"), help="the random criterion's seed")
    ap.add_argument("--ungroup", action="store_true", help="the pruned model routes without expert groups (n_group "
                    "1): any count of at least top-k may be kept, each layer's best over all its experts (where the "
                    "groups cannot keep the same number; --check measures what dropping them alone costs)")  # fmt: skip
    add_check_arguments(ap, how_many)  # --check: the pruned models checked on held-out text, nothing pruned written


def check_flags(args: argparse.Namespace) -> None:
    """The flags' values and combinations, checked before anything is read."""
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1 sequence, got {args.batch_size}")
    if args.trace and args.data:
        raise UserError("--trace holds the calibration documents already; leave out --data (or --trace, to record "
                        "them from --data)")  # fmt: skip
    if args.trace and not (args.trace / "meta.json").is_file():
        raise UserError(f"--trace {args.trace}: not a recorded trace (no meta.json); give analyze's trace/ folder")


def run(args: argparse.Namespace) -> None:
    if checking(args):
        return run_check(args)
    check_flags(args)
    kinds = prunable_kinds()
    settings = check_subject(args, kinds, documents_given=bool(args.trace))  # a --trace holds its documents
    from moe_lm.pruning.run import prune

    # the output (checked first, before any model is loaded) and the source's format: the subject's kind says which
    domains = tuple(args.domains) if args.domains else None
    prune(from_flags(PruneRequest, args, subject=subject_request(args, kinds, settings), out=Path(args.out),
                     documents=documents_request(args), domains=domains))  # fmt: skip


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    main_of(sys.modules[__name__], prog, argv)


if __name__ == "__main__":
    main(prog="python -m moe_lm.cli.prune")
