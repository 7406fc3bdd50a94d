"""Memory per GPU of a training config: weights, gradients, optimizer state, activations, logits, buckets.

    python launch/estimate_memory.py --config configs/gpu_1b.yaml --world 1
    python launch/estimate_memory.py --config configs/deepseek_v3_16b.yaml --world 8
    python launch/estimate_memory.py --config configs/deepseek_v3_671b.yaml --world 256 parallel.ep_size=64 \
        performance.activation_checkpointing=full

The accounting (moe_lm/train/memory.py): ZeRO's mixed-precision bytes per parameter, experts split by ep_size,
activations counted per token and block from the model's own tensors. An estimate: compare it with a measured peak.
"""

from __future__ import annotations

import argparse

from moe_lm.cli import fail, run
from moe_lm.config import ConfigError, load_config
from moe_lm.model import count_params
from moe_lm.train.memory import GB, estimate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--world", type=int, default=1, help="GPUs (data-parallel ranks)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.zero_stage=1")
    args = ap.parse_args()
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        fail(str(e))
    if args.world % cfg.parallel.ep_size:
        fail(f"parallel.ep_size={cfg.parallel.ep_size} must divide --world {args.world}")
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


if __name__ == "__main__":
    run(main)
