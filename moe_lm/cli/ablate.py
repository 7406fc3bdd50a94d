"""Ablate experts: does an expert that specialises in a domain matter for that domain?

    moe-lm ablate --run runs/tiny --out ablation/tiny
    moe-lm ablate --run runs/tiny --targets 3:5 3:1,2 --controls 5 --out ablation
    moe-lm ablate --run runs/tiny --data my_corpus/ --out ablation_mine
    moe-lm ablate --hf path/to/DeepSeek-V2-Lite --data mmlu.parquet --domain-field subject --out ablation_v2lite

For each target (LAYER:EXPERT[,EXPERT...]; default: in every MoE layer, the expert with the highest relative load
on each domain), the model routes around it (tokens take their next choice) and the per-domain loss change is
reported with a 95 % bootstrap interval over documents, next to --controls random same-size sets of experts of the
same layer. --max-documents is spread equally over the domains. Works on moe-lm runs and on transformers MoE
checkpoints (--hf). Writes ablation.json, ablation.md and ablation.png into --out. The same as
`python launch/ablate_experts.py`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from moe_lm.analysis.requests import AblationRequest
from moe_lm.cli import main_of, output_folder
from moe_lm.cli.options import add_out
from moe_lm.cli.subject import add_subject, check_subject, documents_request, reroutable_kinds, subject_request
from moe_lm.errors import UserError, require
from moe_lm.flags import default_of, from_flags


def target(spec: str) -> tuple[int, list[int]]:
    layer, _, experts = spec.partition(":")
    try:
        return int(layer), sorted({int(e) for e in experts.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAYER:EXPERT[,EXPERT...], got {spec!r}") from None


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_subject(ap, reroutable_kinds())
    add_out(ap, "the report folder (created)")
    ap.add_argument("--targets", nargs="*", type=target, metavar="LAYER:EXPERTS", help="experts to route around")
    ap.add_argument("--controls", type=int, default=default_of(AblationRequest, "controls"),
                    help="random same-size expert sets per target")  # fmt: skip
    ap.add_argument("--max-documents", type=int, default=default_of(AblationRequest, "max_documents"),
                    help="documents evaluated, spread equally over domains")  # fmt: skip
    ap.add_argument("--n-boot", type=int, default=default_of(AblationRequest, "n_boot"), help="bootstrap resamples")


def run(args: argparse.Namespace) -> None:
    if args.max_documents < 1:
        raise UserError(f"--max-documents must be at least 1, got {args.max_documents}")
    out = output_folder(args, "ablate")  # why first: a bad --out should fail before any model is loaded
    kinds = reroutable_kinds()
    settings = check_subject(args, kinds)
    require("matplotlib", "analysis", "moe-lm ablate (its figures)")
    from moe_lm.analysis.ablation_workflow import ablate_experts

    with out.staged() as folder:
        ablate_experts(from_flags(AblationRequest, args, subject=subject_request(args, kinds, settings), out=folder,
                                  documents=documents_request(args), targets=tuple(args.targets or ())))  # fmt: skip
    print(f"wrote ablation.json, ablation.md and ablation.png to {out.path}")


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    main_of(sys.modules[__name__], prog, argv)


if __name__ == "__main__":
    main(prog="python -m moe_lm.cli.ablate")
