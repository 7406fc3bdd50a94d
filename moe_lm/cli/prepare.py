"""Prepare data: read the sources, train (or copy) the tokenizer, write token shards with domains and documents.

    moe-lm prepare                                          # the tiny preset's embedded default corpus -> data/default
    moe-lm prepare data.sources=[corpus/] --out data/mine   # your own files (one domain per sub-folder)
    moe-lm prepare --config gpu_1b --workers 2 --force      # rebuild, tokenizing in 2 processes

Re-running skips work already done with the same settings; the vocabulary size is model.vocab_size. The same as
`python launch/prepare_data.py`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from moe_lm.cli import main_of
from moe_lm.cli.options import add_config, load
from moe_lm.errors import UserError


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_config(ap, out="data.out_dir")
    ap.add_argument("--force", action="store_true", help="rebuild even if the data folder is up to date")
    ap.add_argument("--workers", type=int, default=1, help="processes that tokenize")


def run(args: argparse.Namespace) -> None:
    cfg = load(args)
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    from moe_lm.data.prepare import prepare_data

    prepare_data(cfg.data, cfg.model.vocab_size, seed=cfg.seed, force=args.force, workers=args.workers)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    main_of(sys.modules[__name__], prog, argv)


if __name__ == "__main__":
    main(prog="python -m moe_lm.cli.prepare")
