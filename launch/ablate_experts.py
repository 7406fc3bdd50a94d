"""Causal expert ablation: does an expert that specialises in a domain matter for that domain?

    python launch/ablate_experts.py --run runs/tiny --out runs/tiny/ablation
    python launch/ablate_experts.py --run runs/tiny --targets 3:5 3:1,2 --controls 5 --out ablation
    python launch/ablate_experts.py --run runs/tiny --data my_corpus/ --out ablation_mine
    python launch/ablate_experts.py --hf path/to/DeepSeek-V2-Lite --data mmlu.parquet --domain-field subject --out abl

For each target (LAYER:EXPERT[,EXPERT...]; default: in every MoE layer, the expert with the highest relative load
on each domain), the model routes around it (tokens take their next choice) and the per-domain loss change is
reported with a 95 % bootstrap interval over documents, next to --controls random same-size sets of experts of the
same layer. --max-documents is spread equally over the domains (a domain with fewer documents gives the rest to the
others). Works on moe-lm runs and on transformers MoE checkpoints (--hf, the architectures analyze_routing.py
takes). Writes ablation.json, ablation.md and ablation.png into --out.
"""

from __future__ import annotations

import argparse

from moe_lm.analysis.ablation_workflow import ablate_experts
from moe_lm.analysis.subject import add_subject_args, check_subject_args
from moe_lm.cli import output_dir, run


def parse_target(spec: str) -> tuple[int, list[int]]:
    layer, _, experts = spec.partition(":")
    try:
        return int(layer), sorted({int(e) for e in experts.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAYER:EXPERT[,EXPERT...], got {spec!r}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_subject_args(ap)
    ap.add_argument("--out", required=True, help="output folder (created)")
    ap.add_argument("--targets", nargs="*", type=parse_target, help="LAYER:EXPERT[,EXPERT...] to route around")
    ap.add_argument("--controls", type=int, default=3, help="random same-size expert sets per target")
    ap.add_argument(
        "--max-documents", type=int, default=400,
        help="documents to evaluate, spread equally over the domains (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples (default: %(default)s)")
    args = ap.parse_args()
    if args.max_documents < 1:
        ap.error(f"--max-documents must be at least 1, got {args.max_documents}")
    output_dir(args.out)  # why here, before the subject's checks: --out is checked first, as in every script
    check_subject_args(ap, args)
    ablate_experts(args)


if __name__ == "__main__":
    run(main)
