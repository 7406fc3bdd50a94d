"""Generate text from a trained run (KV-cached decoding), optionally drafting with its MTP modules.

    moe-lm generate --run runs/tiny --prompt "def main(" --max-new-tokens 100 --temperature 0.8 --top-p 0.95
    moe-lm generate --run runs/tiny:step_00000500 --prompt "def main(" --temperature 0      # a given checkpoint
    moe-lm generate --run runs/tiny_mtp --prompt "def main(" --speculative mtp               # MTP drafts

--speculative mtp drafts model.mtp.depth tokens per step with the MTP modules and verifies them in one forward pass
of the main model: greedy output is token for token the plain one, sampled output has the plain distribution.
A prompt longer than the context leaves (model.max_seq_len - --max-new-tokens) keeps its last tokens, with a
warning. The same as `python launch/generate.py`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from moe_lm.cli import main_of
from moe_lm.cli.options import add_run, utf8_text
from moe_lm.errors import UserError


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_run(ap)
    ap.add_argument("--prompt", default="", type=utf8_text,
                    help="text to continue (the document-start token is put first)")  # fmt: skip
    ap.add_argument("--max-new-tokens", type=int, default=120, help="new tokens to generate")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    ap.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens; 0 is off")
    ap.add_argument("--top-p", type=float, default=0.95, help="nucleus mass in (0, 1]; 1 is off")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--speculative", choices=["mtp"], default=None, help="draft with the run's MTP modules")
    ap.add_argument("--draft-depth", type=int, default=None, help="MTP modules to draft with (default: all)")


def run(args: argparse.Namespace) -> None:
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p} (1 switches nucleus sampling off)")
    if args.top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0 switches it off), got {args.top_k}")
    if not args.temperature >= 0:  # why `not >=`: NaN is refused too
        raise UserError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    from moe_lm.inference.sampling import Sampling
    from moe_lm.inference.text import generate_text

    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    out = generate_text(
        args.run, args.prompt, args.max_new_tokens, sampling, args.seed, args.speculative == "mtp", args.draft_depth
    )
    for note in out.notes:
        print(note, file=sys.stderr)
    print(out.text)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    main_of(sys.modules[__name__], prog, argv)


if __name__ == "__main__":
    main(prog="python -m moe_lm.cli.generate")
