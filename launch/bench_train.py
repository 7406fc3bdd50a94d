"""Training-step throughput of config variants, side by side: what a feature costs per optimizer step.

    python launch/bench_train.py --config configs/tiny.yaml --arms model.mtp.depth=0 model.mtp.depth=1
    python launch/bench_train.py --config configs/tiny.yaml --arms "" "train.activation_checkpointing=full" \
        "train.compile=true" --rounds 12

Each arm is one set of dotted overrides (space-separated inside one argument; "" = the config as it is). Every arm's
model is built from the same seed and trained on the same random token batches (micro_batch_size x seq_len, the
config's) with the same objective as launch/train.py (main CE + lambda/D * MTP CEs + balance losses, the bias
update; activation checkpointing, compile and the chunked loss as configured), one optimizer step (torch AdamW) per
timing, in one process. The arms take turns round by round, so that a shared machine's noise hits all of them
alike; medians and ratios to the first arm are printed. DeepSpeed's per-step bookkeeping is the same for every arm
and is left out.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moe_lm.cli import run
from moe_lm.config import ConfigError, load_config
from moe_lm.model import build_model
from moe_lm.parallel.deepspeed_setup import param_groups
from moe_lm.train.balance import balance_step
from moe_lm.train.flops import train_flops_per_token
from moe_lm.train.objective import next_token_losses, total_loss
from moe_lm.train.recompute import apply_activation_checkpointing, apply_compile


class Arm:
    def __init__(self, name: str, cfg) -> None:
        self.name, self.cfg = name, cfg
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model).train()
        model = apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
        self.model = apply_compile(model, cfg.train.compile)
        o = cfg.optim
        self.opt = torch.optim.AdamW(param_groups(self.model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2))
        self.depth = cfg.model.mtp.depth
        self.times: list[float] = []

    def step(self, batch: torch.Tensor) -> None:
        chunk = self.cfg.train.loss_chunk
        out = self.model(batch[:, :-1], mtp=self.depth > 0, logits=not chunk)
        ce, mtp = next_token_losses(out, batch[:, 1:], self.model.lm_head.weight, chunk)
        total_loss(ce, mtp, self.cfg.model.mtp.loss_weight, out.aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        balance_step(self.model, self.cfg.model.moe.bias_update_speed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--arms", nargs="+", required=True, help='overrides per arm, e.g. "model.mtp.depth=1"')
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        arms = [Arm(spec or "(config)", load_config(args.config, spec.split())) for spec in args.arms]
    except ConfigError as e:
        ap.error(str(e))
    t = arms[0].cfg.train
    shapes = {(a.cfg.train.micro_batch_size, a.cfg.train.seq_len, a.cfg.model.vocab_size) for a in arms}
    if len(shapes) > 1:
        ap.error(f"the arms must share micro_batch_size, seq_len and vocab_size to see the same batches: {shapes}")
    gen = torch.Generator().manual_seed(0)
    tokens = t.micro_batch_size * t.seq_len
    print(
        f"{len(arms)} arms, {args.rounds} rounds (+{args.warmup} warm-up) of one optimizer step on "
        f"{t.micro_batch_size} x {t.seq_len} tokens, {torch.get_num_threads()} threads"
    )
    for r in range(args.warmup + args.rounds):
        batch = torch.randint(0, arms[0].cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=gen)
        for arm in arms:
            t0 = time.perf_counter()
            arm.step(batch)
            if r >= args.warmup:
                arm.times.append(time.perf_counter() - t0)
    base = statistics.median(arms[0].times)
    print(f"| arm | median ms/step (min-max) | tokens/s | model GFLOP/step | time vs {arms[0].name} |")
    print("|---|---|---|---|---|")
    for arm in arms:
        med = statistics.median(arm.times)
        flops = train_flops_per_token(arm.cfg.model, t.seq_len, arm.cfg.train.prefix_len) * tokens / 1e9
        spread = f"{1e3 * min(arm.times):.1f}-{1e3 * max(arm.times):.1f}"
        print(f"| {arm.name} | {1e3 * med:.1f} ({spread}) | {tokens / med:,.0f} | {flops:.2f} | {med / base:.3f} |")


if __name__ == "__main__":
    run(main)
