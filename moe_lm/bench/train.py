"""Training-step throughput of config variants, side by side: what a feature costs per optimizer step.

    python -m moe_lm.bench train --config configs/tiny.yaml --arms model.mtp.depth=0 model.mtp.depth=1
    python -m moe_lm.bench train --config configs/tiny.yaml --arms "" "performance.activation_checkpointing=full" \
        "performance.compile=true" --rounds 12
    python -m moe_lm.bench train --config tiny --peers             # ours vs HF DeepseekV3ForCausalLM vs dense
    python -m moe_lm.bench train --config gpu_1b --speed --device cuda --dtype bfloat16   # issue 65's changes
    python -m moe_lm.bench train --config tiny --peers model.dim=512 model.n_heads=8 model.vocab_size=32768 \
        model.moe.moe_inter_dim=256 model.moe.num_experts_per_tok=3 model.inter_dim=1024

Each arm is one set of dotted overrides (space-separated inside one argument; "" = the config as it is). Every arm's
model is built from the same seed and trained on the same random token batches (micro_batch_size x seq_len, the
config's) with the same objective as `moe-lm train` (main CE + lambda/D * MTP CEs + balance losses, the bias
update; activation checkpointing, compile and the chunked loss as configured), one optimizer step (torch AdamW) per
timing, in one process. The arms take turns round by round, so that a shared machine's noise hits all of them
alike; medians and ratios to the first arm are printed. DeepSpeed's per-step bookkeeping is the same for every arm
and is left out. Overrides after the flags apply to every arm. `--peers` times the whole step against HF's
`DeepseekV3ForCausalLM`, our dense model of equal active FLOPs (moe_lm/bench/arms.py) and, where it is installed,
torchtitan's DeepSeek-V3 (moe_lm/bench/torchtitan_arm.py). `--speed` times the step as it was before issue 65's
changes to the step (dispatch, attention: moe_lm/bench/before_65.py) against the step with one of them undone and
the step as it is, eager, then the step before and now compiled, in a second interleaved run.
"""

from __future__ import annotations

import argparse
import time

import torch

from moe_lm.bench.arms import Arm, HFArm, StepArm, dense_twin
from moe_lm.bench.before_65 import CHANGES
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
        help="arms: ours eager and compiled, HF DeepseekV3ForCausalLM (eager, grouped_mm experts), dense twin, "
        "torchtitan's DeepSeek-V3 where it is installed",
    )
    ap.add_argument(
        "--speed",
        action="store_true",
        help="arms: the step before issue 65's changes, with the dispatch or the attention change undone, and as it "
        "is; eager, then before and now compiled",
    )
    ap.add_argument(
        "--no-compile", action="store_true",
        help="with --peers or --speed: leave out the compiled arms (their compilation can take minutes at GPU sizes)",
    )  # fmt: skip
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for every arm")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds of one step per arm")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds before them")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--device", default="cpu", type=torch_device, help="torch device of every arm (cuda: synchronised timings)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and activations")


def build_arms(
    config: str, specs: list[str], common: list[str] = (), device: str = "cpu", dtype=torch.float32, undone=None
):
    """One arm per override spec (after the common overrides), with the changes `undone` names for it (a tuple
    per spec: moe_lm/bench/before_65.py); arms that would not see the same batches are refused."""
    undone = undone or [()] * len(specs)
    arms = [
        Arm(spec or "(config)", load_config(preset_path(config), [*common, *spec.split()]), device, dtype, back)
        for spec, back in zip(specs, undone, strict=True)
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
    if bool(args.arms) + args.peers + args.speed != 1:
        raise UserError("give --arms, --peers or --speed (one of them)")
    place = (args.device, getattr(torch, args.dtype))
    if args.speed:
        return run_speed(args, place)
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


SPEED_ARMS = {  # name -> the changes undone (moe_lm/bench/before_65.py); the first is the reference
    "before issue 65": CHANGES,
    "dispatch as before": ("dispatch",),
    "attention as before": ("attention",),
    "now": (),
}
SPEED_COMPILED = ("before issue 65", "now")


def run_speed(args: argparse.Namespace, place: tuple) -> None:
    """`--speed`: the eager arms in one interleaved run, then (unless --no-compile) the compiled ones in another,
    the first run's models freed before the second's are built (two sets of gpu_1b do not fit an 80 GB GPU)."""
    medians = {}
    runs = [("", "performance.compile=false", list(SPEED_ARMS))]
    if not args.no_compile:
        runs.append((" compiled", "performance.compile=true", list(SPEED_COMPILED)))
    for suffix, compile_spec, names in runs:
        arms = build_arms(args.config, [compile_spec] * len(names), args.overrides, *place,
                          undone=[SPEED_ARMS[n] for n in names])  # fmt: skip
        for arm, name in zip(arms, names, strict=True):
            arm.name = name + suffix
        t = arms[0].cfg.train
        print(f"{len(arms)} arms{suffix or ' eager'}, {args.rounds} rounds (+{args.warmup} warm-up) of one optimizer "
              f"step on {t.micro_batch_size} x {t.seq_len} tokens, {torch.get_num_threads()} threads")  # fmt: skip
        stats = time_arms(arms, args.rounds, args.warmup, args.device)
        print(table(arms, stats))
        medians.update({arm.name: s.median for arm, s in zip(arms, stats, strict=True)})
        del arms
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()
    print(speed_summary(medians))


def speed_summary(t: dict[str, float]) -> str:
    """The ratios the GPU check reads: now over before, eager and compiled, and each change alone (the step with
    it, now, over the step with it undone)."""
    line = f"now / before issue 65: eager {t['now'] / t['before issue 65']:.3f}"
    if "now compiled" in t:
        line += f", compiled {t['now compiled'] / t['before issue 65 compiled']:.3f}"
    return line + (
        f"; the dispatch change alone {t['now'] / t['dispatch as before']:.3f}, "
        f"the attention change alone {t['now'] / t['attention as before']:.3f}"
    )


def peer_arms(config: str, common: list[str], device: str = "cpu", dtype=torch.float32, compiled: bool = True) -> list:
    """Ours (eager, and compiled unless not `compiled`), HF on the same weights (eager, grouped_mm experts), the
    dense twin, and torchtitan on the same weights where it can run."""
    specs = ["performance.compile=false", "performance.compile=true"][: 1 + compiled]
    ours, *compiled_arm = build_arms(config, specs, common, device, dtype)
    ours.name = "ours"
    for arm in compiled_arm:
        arm.name = "ours compiled"
    (dense,) = build_arms(config, [" ".join(dense_twin(ours.cfg))], common, device, dtype)
    dense.name = "dense (equal active FLOPs)"
    hf = [HFArm(f"HF {impl}", ours.cfg, ours.model, impl, device, dtype) for impl in ("eager", "grouped_mm")]
    return [ours, *compiled_arm, *hf, dense, *torchtitan_arm(ours, device, dtype)]


def torchtitan_arm(ours: Arm, device: str, dtype) -> list:
    """torchtitan's DeepSeek-V3 at our shape with our weights, where it can run here; else one line says why not."""
    from moe_lm.bench.torchtitan_arm import TorchtitanArm, unavailable

    why = unavailable(ours.cfg.model)
    if why:
        print(f"torchtitan arm left out: {why}")
        return []
    t, start = ours.cfg.train, time.perf_counter()
    try:
        arm = TorchtitanArm("torchtitan", ours.cfg, ours.model, device, dtype)
        # why printed before and after: a log cut in between was its first step (on a GPU, FlexAttention's compile)
        print(f"torchtitan arm: built with our weights in {time.perf_counter() - start:.1f} s ({arm.attention}); "
              "its first step, untimed:", end=" ", flush=True)  # fmt: skip
        start = time.perf_counter()
        arm.step(torch.randint(0, ours.cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), device=device))
    except Exception as e:  # noqa: BLE001 - another library failing on this machine must not cost the other arms
        print(f"\ntorchtitan arm left out: it failed here: {type(e).__name__}: {str(e)[:300]}")
        return []
    print(f"{time.perf_counter() - start:.1f} s")
    return [arm]


def summary(names: list[str], medians: list[float]) -> str:
    """The ratios the README quotes: ours (eager, compiled) over HF's faster implementation, over dense, and over
    torchtitan where its arm ran."""
    t = dict(zip(names, medians, strict=True))
    hf = min(t["HF eager"], t["HF grouped_mm"])
    compiled = f"ours compiled / HF best {t['ours compiled'] / hf:.3f}; " if "ours compiled" in t else ""
    titan = f"; ours eager / torchtitan {t['ours'] / t['torchtitan']:.3f}" if "torchtitan" in t else ""
    return (
        f"ours eager / HF best {t['ours'] / hf:.3f}; {compiled}"
        f"ours eager / dense eager {t['ours'] / t['dense (equal active FLOPs)']:.3f}{titan}"
    )
