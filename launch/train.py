"""Train a DeepSeek-V3-style MoE language model under DeepSpeed.

    deepspeed launch/train.py --config configs/tiny.yaml [key=value ...]
    deepspeed --num_gpus 2 launch/train.py --config configs/tiny.yaml train.out_dir=runs/tiny2
    python launch/train.py --config configs/tiny.yaml          # a single process without the launcher

Re-running with the same train.out_dir resumes from its latest complete checkpoint; train.resume=false starts
afresh (moving the old run folder aside).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from moe_lm.config import ConfigError, load_config
from moe_lm.data.documents import DataError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=100 optim.lr=1e-3")
    args = ap.parse_args()
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        sys.exit(f"error: {e}")

    from moe_lm.data.prepare import load_split
    from moe_lm.parallel.deepspeed_setup import remove_shm_buffers, shutdown_distributed
    from moe_lm.train import RunError
    from moe_lm.train.loop import train
    from moe_lm.train.stop import Stopped

    try:
        final = train(cfg)
    except (ConfigError, DataError, RunError) as e:
        sys.exit(f"error: {e}")
    except Stopped as e:
        print(e, file=sys.stderr)
        sys.exit(e.exit_code)
    finally:
        # why on every path: DeepSpeed's CPU all-reduce buffers in /dev/shm outlive the process (docs/deepspeed.md
        # §6); unlinking a file other ranks still map is safe
        remove_shm_buffers(os.environ.get("MASTER_PORT", ""))
    shutdown_distributed()
    if int(os.environ.get("RANK", 0)) != 0 or not final:
        return
    tokens = np.asarray(load_split(cfg.data.out_dir, "train").tokens)
    h = unigram_entropy(tokens, cfg.model.vocab_size)
    per_domain = ", ".join(f"{k[5:]} {v:.3f}" for k, v in final.items() if k.startswith("loss/"))
    print(f"final validation loss {final['loss']:.3f} nats (per domain: {per_domain})")
    print(f"unigram entropy of the training corpus {h:.3f} nats; run folder {cfg.train.out_dir}")


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the corpus' token frequencies: the loss of the best context-free predictor."""
    p = np.bincount(np.asarray(tokens), minlength=vocab_size).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


if __name__ == "__main__":
    main()
