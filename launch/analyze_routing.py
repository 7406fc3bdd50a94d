"""Record which expert every token chose and draw the figures MoE papers report, with baselines.

    python launch/analyze_routing.py --run runs/tiny --out runs/tiny/analysis
    python launch/analyze_routing.py --run runs/tiny --data my_corpus/ --out analysis_mine --tokens . , the what
    python launch/analyze_routing.py --run runs/tiny --compare runs/tiny:step_00000250 --out analysis  # saturation
    python launch/analyze_routing.py --hf path/to/DeepSeek-V2-Lite --data corpus/ --out analysis_v2lite

--run: a moe-lm run (default data: its validation split, documents with their domains); --hf: a transformers MoE
checkpoint (DeepseekV3/V2, Glm4Moe, Qwen2Moe/Qwen3Moe, OlmoE, Mixtral) with its own tokenizer, in --dtype on
--device. --data takes .txt/.jsonl files or folders (a sub-folder per domain), tokenised with the subject's
tokenizer. Writes into --out: trace/ (the recorded routing, see moe_lm/analysis/trace.py), trace_init/ (the same
tokens through the untrained model: baseline N1, for --hf the architecture re-initialised), figures/*.png,
routing.html and metrics.json; with --wandb, logs the figures to the run's own wandb run too. The token budget
(--max-tokens) is spread equally over the domains (a domain with less text gives the rest to the others); the
console and metrics.json say what each domain contributed, and warn about a domain with less than its share.
"""

from __future__ import annotations

import argparse

from moe_lm.analysis.routing_workflow import analyze_routing
from moe_lm.analysis.subject import add_subject_args, check_subject_args
from moe_lm.checkpoint.format import parse_run
from moe_lm.cli import output_dir, run

DEFAULT_TOKENS = [".", ",", "the", "(", "def", "\n", "what"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_subject_args(ap)
    ap.add_argument("--out", required=True, help="output folder (created)")
    ap.add_argument(
        "--compare", type=parse_run, help="another checkpoint (RUN or RUN:TAG) routed on the same tokens: saturation"
    )
    ap.add_argument("--tokens", nargs="*", default=DEFAULT_TOKENS, help="tokens for per-token charts")
    ap.add_argument(
        "--max-tokens", type=int, default=200_000,
        help="token budget, spread equally over the domains (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--min-count", type=int, default=20, help="minimum occurrences for vocabulary specialisation")
    ap.add_argument("--no-init-baseline", action="store_true", help="skip the untrained-model baseline (N1)")
    ap.add_argument(
        "--layers",
        nargs="*",
        type=int,
        help="MoE layers to draw and tabulate (default: all up to 8 MoE layers, "
        "else the first, middle and last; the metrics cover every layer)",
    )
    ap.add_argument("--wandb", action="store_true", help="also log the figures to the run's own wandb run")
    args = ap.parse_args()
    if args.max_tokens < 1:
        ap.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    output_dir(args.out)  # why here, before the subject's checks: --out is checked first, as in every script
    check_subject_args(ap, args)
    analyze_routing(args)


if __name__ == "__main__":
    run(main)
