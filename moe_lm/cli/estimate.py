"""Estimate memory per GPU of a training config: weights, gradients, optimizer state, activations, logits, buckets.

    moe-lm estimate --config gpu_1b --world 1
    moe-lm estimate --config deepseek_v3_16b --world 8
    moe-lm estimate --config deepseek_v3_671b --world 256 parallel.ep_size=64 performance.activation_checkpointing=full

The accounting (moe_lm/train/memory.py): ZeRO's mixed-precision bytes per parameter, experts split by ep_size,
activations counted per token and block from the model's own tensors. An estimate: compare it with a measured
peak (peak_mem_gib in every train row on CUDA). The same as `python launch/estimate_memory.py`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from moe_lm.cli import main_of
from moe_lm.cli.options import add_config, load
from moe_lm.config import require_ep_divides
from moe_lm.errors import UserError


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_config(ap)
    ap.add_argument("--world", type=int, default=1, help="GPUs in all (data-parallel ranks)")


def run(args: argparse.Namespace) -> None:
    cfg = load(args)
    if args.world < 1:
        raise UserError(f"--world must be >= 1, got {args.world}")
    require_ep_divides(cfg.parallel.ep_size, cfg.model.moe.n_routed_experts, args.world)
    from moe_lm.model import count_params
    from moe_lm.train.memory import GB, estimate

    n, m, t = count_params(cfg.model), estimate(cfg, args.world), cfg.train
    recompute = cfg.performance.activation_checkpointing
    print(
        f"{args.config}: {n.total / 1e9:.3f} B parameters ({n.active / 1e9:.3f} B active)"
        + (f" + MTP {n.mtp_total / 1e9:.3f} B" if n.mtp_total else "")
        + f"; bf16 training, world {args.world}, ZeRO-{cfg.parallel.zero_stage}, ep_size {cfg.parallel.ep_size}, "
        f"micro-batch {t.micro_batch_size} x {t.seq_len}, activation checkpointing {recompute}"
    )
    for name in ("weights", "gradients", "optimizer", "activations", "logits", "buckets"):
        print(f"  {name:12s} {getattr(m, name) / GB:8.2f} GiB")
    print(f"  {'total':12s} {m.total / GB:8.2f} GiB per GPU")


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    main_of(sys.modules[__name__], prog, argv)


if __name__ == "__main__":
    main(prog="python -m moe_lm.cli.estimate")
