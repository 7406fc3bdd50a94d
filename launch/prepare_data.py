"""Build the corpus, train the tokenizer and write token shards for a config.

    python launch/prepare_data.py --config configs/tiny.yaml                       # the embedded default corpus
    python launch/prepare_data.py --config configs/tiny.yaml data.sources=[my.jsonl] data.out_dir=data/mine
    python launch/prepare_data.py --config configs/tiny.yaml --force               # rebuild

Re-running skips work already done (same settings); the vocabulary size is model.vocab_size.
"""

from __future__ import annotations

import argparse

from moe_lm.cli import fail, run
from moe_lm.config import ConfigError, load_config
from moe_lm.data.documents import DataError
from moe_lm.data.prepare import prepare_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--force", action="store_true", help="rebuild even if the data folder is up to date")
    ap.add_argument("--workers", type=int, default=1, help="processes that tokenize (default 1)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. data.out_dir=data/mine")
    args = ap.parse_args()
    try:
        cfg = load_config(args.config, args.overrides)
        if args.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {args.workers}")
        prepare_data(cfg.data, cfg.model.vocab_size, seed=cfg.seed, force=args.force, workers=args.workers)
    except (ConfigError, DataError) as e:
        fail(str(e))


if __name__ == "__main__":
    run(main)
