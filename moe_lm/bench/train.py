"""Training-step throughput of config variants, side by side: what a feature costs per optimizer step.

    python -m moe_lm.bench train --config configs/tiny.yaml --arms model.mtp.depth=0 model.mtp.depth=1
    python -m moe_lm.bench train --config configs/tiny.yaml --arms "" "performance.activation_checkpointing=full" \
        "performance.compile=true" --rounds 12
    python -m moe_lm.bench train --config tiny --peers             # ours vs HF DeepseekV3ForCausalLM vs dense
    python -m moe_lm.bench train --config tiny --peers model.dim=512 model.n_heads=8 model.vocab_size=32768 \
        model.moe.moe_inter_dim=256 model.moe.num_experts_per_tok=3 model.inter_dim=1024

Each arm is one set of dotted overrides (space-separated inside one argument; "" = the config as it is). Every arm's
model is built from the same seed and trained on the same random token batches (micro_batch_size x seq_len, the
config's) with the same objective as `moe-lm train` (main CE + lambda/D * MTP CEs + balance losses, the bias
update; activation checkpointing, compile and the chunked loss as configured), one optimizer step (torch AdamW) per
timing, in one process. The arms take turns round by round, so that a shared machine's noise hits all of them
alike; medians and ratios to the first arm are printed. DeepSpeed's per-step bookkeeping is the same for every arm
and is left out. Overrides after the flags apply to every arm. `--peers` times the whole step against HF's
`DeepseekV3ForCausalLM` and our dense model of equal active FLOPs (moe_lm/bench/arms.py).
"""

from __future__ import annotations

import argparse

import torch

from moe_lm.bench.arms import Arm, HFArm, StepArm, dense_twin
from moe_lm.bench.timing import Stat, markdown_table, no_sync, time_interleaved
from moe_lm.config import load_config, preset_path
from moe_lm.errors import UserError
from moe_lm.flags import torch_device


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", default="tiny", metavar="NAME|FILE", help="the config every arm starts from")
    ap.add_argument(
        "--arms",
        nargs="+",
        default=None,
        help='overrides per arm, e.g. "model.mtp.depth=1" ("": the config as it is); ratios are to the first',
    )
    ap.add_argument(
        "--peers",
        action="store_true",
        help="arms: ours eager and compiled, HF DeepseekV3ForCausalLM (eager, grouped_mm experts), dense twin",
    )
    ap.add_argument(
        "--no-compile", action="store_true",
        help="with --peers: leave out the compiled arm (its compilation can take minutes at GPU sizes)",
    )  # fmt: skip
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for every arm")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds of one step per arm")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds before them")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--device", default="cpu", type=torch_device, help="torch device of every arm (cuda: synchronised timings)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and activations")


def build_arms(config: str, specs: list[str], common: list[str] = (), device: str = "cpu", dtype=torch.float32):
    """One arm per override spec (after the common overrides); arms that would not see the same batches are
    refused."""
    arms = [
        Arm(spec or "(config)", load_config(preset_path(config), [*common, *spec.split()]), device, dtype)
        for spec in specs
    ]
    shapes = {(a.cfg.train.micro_batch_size, a.cfg.train.seq_len, a.cfg.model.vocab_size) for a in arms}
    if len(shapes) > 1:
        raise UserError(
            f"the arms must share micro_batch_size, seq_len and vocab_size to see the same batches: {shapes}"
        )
    return arms


def time_arms(arms: list[StepArm], rounds: int, warmup: int, device: str = "cpu") -> list[Stat]:
    """Seconds per optimizer step of each arm (ratios to the first); every round draws one batch that all arms
    step on."""
    t, vocab = arms[0].cfg.train, arms[0].cfg.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    batch = torch.empty(0, dtype=torch.long)

    def draw(r: int) -> None:
        nonlocal batch
        batch = torch.randint(0, vocab, (t.micro_batch_size, t.seq_len + 1), generator=gen).to(device)

    # keyed by position: two arms may carry the same overrides (an A/A run shows the noise)
    steps = {str(i): (lambda arm=arm: arm.step(batch)) for i, arm in enumerate(arms)}
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else no_sync
    stats = time_interleaved(steps, rounds, warmup, before_round=draw, sync=sync)
    return [stats[str(i)] for i in range(len(arms))]


def table(arms: list[StepArm], stats: list[Stat]) -> str:
    columns = ["arm", "median ms/step (min-max)", "tokens/s", "model GFLOP/step", f"time vs {arms[0].name}"]
    rows = [
        [arm.name, f"{1e3 * s.median:.1f} ({1e3 * s.min:.1f}-{1e3 * s.max:.1f})", f"{arm.tokens / s.median:,.0f}",
         f"{arm.gflops_per_step():.2f}", f"{s.ratio:.3f}"]
        for arm, s in zip(arms, stats, strict=True)
    ]  # fmt: skip
    return markdown_table(columns, rows)


def run(args: argparse.Namespace) -> None:
    if args.rounds < 1 or args.warmup < 0 or args.threads < 0:
        raise UserError("--rounds must be >= 1, --warmup and --threads >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    if bool(args.arms) == args.peers:
        raise UserError("give --arms or --peers (one of them)")
    place = (args.device, getattr(torch, args.dtype))
    if args.peers:
        arms = peer_arms(args.config, args.overrides, *place, compiled=not args.no_compile)
    else:
        arms = build_arms(args.config, args.arms, args.overrides, *place)
    t = arms[0].cfg.train
    print(
        f"{len(arms)} arms, {args.rounds} rounds (+{args.warmup} warm-up) of one optimizer step on "
        f"{t.micro_batch_size} x {t.seq_len} tokens, {torch.get_num_threads()} threads"
    )
    stats = time_arms(arms, args.rounds, args.warmup, args.device)
    print(table(arms, stats))
    if args.peers:
        print(summary([a.name for a in arms], [s.median for s in stats]))


def peer_arms(config: str, common: list[str], device: str = "cpu", dtype=torch.float32, compiled: bool = True) -> list:
    """Ours (eager, and compiled unless not `compiled`), HF on the same weights (eager, grouped_mm experts), and
    the dense twin."""
    ours, *compiled_arm = build_arms(config, ["", "performance.compile=true"][: 1 + compiled], common, device, dtype)
    ours.name = "ours"
    for arm in compiled_arm:
        arm.name = "ours compiled"
    (dense,) = build_arms(config, [" ".join(dense_twin(ours.cfg))], common, device, dtype)
    dense.name = "dense (equal active FLOPs)"
    hf = [HFArm(f"HF {impl}", ours.cfg, ours.model, impl, device, dtype) for impl in ("eager", "grouped_mm")]
    return [ours, *compiled_arm, *hf, dense]


def summary(names: list[str], medians: list[float]) -> str:
    """The ratios the README quotes: ours (eager, compiled) over HF's faster implementation and over dense."""
    t = dict(zip(names, medians, strict=True))
    hf = min(t["HF eager"], t["HF grouped_mm"])
    compiled = f"ours compiled / HF best {t['ours compiled'] / hf:.3f}; " if "ours compiled" in t else ""
    return (
        f"ours eager / HF best {t['ours'] / hf:.3f}; {compiled}"
        f"ours eager / dense eager {t['ours'] / t['dense (equal active FLOPs)']:.3f}"
    )
