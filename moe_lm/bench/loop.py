"""The training loop's step against the model step: what `moe-lm train` adds around the model, and where.

    moe-lm bench loop                                    # the tiny preset: the loop's step vs the model step
    moe-lm bench loop train.grad_accum_steps=4           # overrides for every arm (gpu_1b accumulates 4)
    moe-lm bench loop --arms "" "parallel.zero_stage=1"  # loop arms of other settings, beside the model step
    moe-lm bench loop --profile                          # the loop's step and the model step by part

The model step is `moe-lm bench train`'s (`Arm`: the model and torch's fused AdamW, no DeepSpeed) on the loop's device
and dtype (parallel.dtype), over the same micro-batches: each one's loss / grad_accum_steps backpropagated, then
clipping, AdamW and the bias update. A loop arm is the training loop's own step (moe_lm/train/loop.py) on the model
and DeepSpeed engine `moe-lm train` builds (`build_trainee`): the engine's forward, backward and step, the losses'
all-reduce, the bias update, the signal check, the throughput, and every cadence.log_interval steps a logged row
(into metrics.jsonl of a temporary run folder; wandb off, no evaluation, no checkpoint). The arms take turns in rounds
of `--steps` optimizer steps (default cadence.log_interval: each round logs once), all on the same samples of one
random token stream; the table gives milliseconds per optimizer step and the ratio to the model step.

`--profile` times the parts of `--steps` steps of the first loop arm and of the model step, each part's own time
(what it calls that has a part of its own is taken out): the model's forward, loss and autograd backward, DeepSpeed's
ZeRO work (its gradient hooks' copies into the reduction bucket, the bucket's reduction, the copies into the flat
partition, the gradient norm, clipping, AdamW on the fp32 master partition, the copy back and all-gather) and the
loop's own bookkeeping. On CUDA every part's edges synchronise the device, so the parts add up to more than a step.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_lm.bench.loop_steps import LoopStep, ModelStep, bench_config, random_windows
from moe_lm.bench.timing import markdown_table, time_interleaved
from moe_lm.errors import UserError
from moe_lm.flags import from_flags

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", default="tiny", metavar="NAME|FILE", help="the config every arm starts from")
    ap.add_argument(
        "--arms", nargs="+", default=[""],
        help='loop arms, overrides each ("": the config as it is); the model step is the reference',
    )  # fmt: skip
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for every arm")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds before them")
    ap.add_argument("--steps", type=int, default=0, help="optimizer steps per arm and round (0: cadence.log_interval)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--profile", action="store_true", help="the steps by part instead of the interleaved timing")
    ap.add_argument(
        "--before", action="store_true",
        help="one more loop arm: the loop as it was before issue 65's work on it (moe_lm/bench/loop_before.py)",
    )  # fmt: skip
    ap.add_argument(
        "--clock", default="wall", choices=list(CLOCKS),
        help="what a step's time is: wall time, or this process's CPU time (on a busy machine it leaves out the waits "
        "for a core; with one thread it is the step's own work)",
    )  # fmt: skip


@dataclass(frozen=True)
class LoopBench:
    config: str
    arms: list
    overrides: list
    rounds: int
    warmup: int
    steps: int
    threads: int
    profile: bool
    clock: str = "wall"
    before: bool = False


def time_steps(arms: list, rounds: int, warmup: int, steps: int, clock: str = "wall") -> list:
    """Seconds per optimizer step of each arm, timed in interleaved rounds of `steps` steps on the same samples."""
    at = {"first": 0}

    def next_round(r: int) -> None:
        at["first"] = r * steps

    calls = {str(i): (lambda arm=arm: arm.steps(at["first"], steps)) for i, arm in enumerate(arms)}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else _no_sync
    stats = time_interleaved(calls, rounds, warmup, clock=CLOCKS[clock], sync=sync, before_round=next_round)
    return [stats[str(i)] for i in range(len(arms))]


def _no_sync() -> None:
    pass


def table(arms: list, stats: list, steps: int) -> str:
    tokens = arms[0].cfg.global_batch(1) * arms[0].cfg.train.seq_len
    columns = ["arm", "ms per optimizer step (min-max)", "tokens/s", "time vs model step", "speed vs model step"]
    rows = [
        [arm.name, f"{1e3 * s.median / steps:.1f} ({1e3 * s.min / steps:.1f}-{1e3 * s.max / steps:.1f})",
         f"{tokens * steps / s.median:,.0f}", f"{s.ratio:.3f}", f"{1 / s.ratio:.3f}"]
        for arm, s in zip(arms, stats, strict=True)
    ]  # fmt: skip
    return markdown_table(columns, rows)


# ---- the profile: each part's own time ---------------------------------------------------------------------------


class PartClock:
    """Wall time by labelled part, each part's own: a part's labelled sub-parts are taken out of its time."""

    def __init__(self, sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter) -> None:
        self.own: dict[str, float] = defaultdict(float)
        self._inner: list[float] = []
        self.sync, self.clock = sync, clock

    @contextlib.contextmanager
    def part(self, label: str) -> Iterator[None]:
        self.sync()
        t0 = self.clock()
        self._inner.append(0.0)
        try:
            yield
        finally:
            self.sync()
            took = self.clock() - t0
            self.own[label] += took - self._inner.pop()
            if self._inner:
                self._inner[-1] += took

    def timed(self, fn: Callable, label: str) -> Callable:
        def run(*args, **kwargs):
            with self.part(label):
                return fn(*args, **kwargs)

        return run


@contextlib.contextmanager
def labelled(clock: PartClock, targets: list[tuple[object, str, str]]) -> Iterator[None]:
    """Each (owner, attribute, label) whose owner has that attribute: the attribute replaced by a timed call of
    itself within the block (on an instance, a module or a class's instance alike), put back after it."""
    replaced = []
    for owner, name, label in targets:
        if owner is None or not hasattr(owner, name):
            continue
        had_own = name in getattr(owner, "__dict__", {})
        replaced.append((owner, name, getattr(owner, name), had_own))
        setattr(owner, name, clock.timed(getattr(owner, name), label))
    try:
        yield
    finally:
        for owner, name, original, had_own in reversed(replaced):
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


FORWARD, LOSS, BACKWARD = "model: forward", "model: loss", "model: backward (autograd)"
NORM, CLIP, ADAMW, BALANCE = "gradient norm", "clipping", "AdamW", "balance_step (counts, bias update, metrics)"
ZERO_BOOKKEEPING = "ZeRO: bookkeeping (gradient hooks, buckets, epilogue)"
ZERO_REDUCTION = "ZeRO: gradients divided, flattened, all-reduced, copied back"


def loop_parts(arm: LoopStep) -> list[tuple[object, str, str]]:
    """What to time in the loop's step: the engine's calls, ZeRO's internals, the loop's bookkeeping."""
    from deepspeed.runtime.zero import stage_1_and_2

    from moe_lm.train import loop, step

    run, engine = arm.run, arm.run.engine
    zero = engine.optimizer
    return [
        (engine, "forward", FORWARD),
        (step, "next_token_losses", LOSS),
        (engine, "backward", BACKWARD),
        (zero, "reduce_independent_p_g_buckets_and_remove_grads", "ZeRO: gradient copied into the bucket"),
        (zero, "average_tensor", ZERO_REDUCTION),
        (zero, "buffered_reduce_fallback", ZERO_REDUCTION),
        (zero, "copy_grads_in_partition", "ZeRO: gradient copied into the flat partition"),
        (zero, "process_gradients", ZERO_BOOKKEEPING),
        (zero, "update_hook_state_and_maybe_run_epilogue", ZERO_BOOKKEEPING),
        (zero, "reduce_ipg_grads", ZERO_BOOKKEEPING),
        (zero, "reduce_gradients", ZERO_BOOKKEEPING),
        (zero, "independent_gradient_partition_epilogue", ZERO_BOOKKEEPING),
        (engine, "allreduce_gradients", "gradient all-reduce (engine)"),
        (engine, "step", "engine.step: other"),
        (zero, "step", "ZeRO step: flatten, fp32 grad, copy back"),
        (zero, "check_overflow", "overflow check"),
        (zero, "scaled_global_norm", NORM),
        (zero, "unscale_and_clip_grads", CLIP),
        (engine, "clip_fp32_gradients", CLIP),
        (zero, "_optimizer_step", ADAMW + " (fp32 master partition)"),
        (stage_1_and_2, "all_gather_dp_groups", "ZeRO: all-gather of the updated weights"),
        (zero, "zero_grad", "zero_grad"),
        (step, "_step_losses", "losses: all-reduce, .tolist()"),
        (loop, "balance_step", BALANCE),
        (loop, "_log_train", "logged row (grad norm, metrics.jsonl, console)"),
        (run, "throughput", "throughput (tokens/s, MFU)"),
        (arm.stop, "requested", "signal check"),
        (run.windows, "batch", "data: micro-batches"),
    ]


def model_parts(arm: ModelStep) -> list[tuple[object, str, str]]:
    from moe_lm.bench import arms

    return [
        (arm.arm, "forward", FORWARD),
        (arm.arm, "loss", LOSS),
        (torch.Tensor, "backward", BACKWARD),
        (torch.nn.utils, "clip_grad_norm_", NORM + " + " + CLIP),
        (arm.arm.opt, "step", ADAMW),
        (arm.arm.opt, "zero_grad", "zero_grad"),
        (arms, "balance_step", BALANCE),
        (arm.windows, "batch", "data: micro-batches"),
    ]


def profile_parts(arm, parts: list, first_step: int, steps: int, sync, clock: str) -> tuple[dict[str, float], float]:
    """Seconds per step by part (own times; "other" is what no part holds) and per step in all."""
    clock = PartClock(sync, CLOCKS[clock])
    held = getattr(arm, "as_before", contextlib.nullcontext)  # why first: the parts then wrap the old functions
    with held(), labelled(clock, parts), clock.part("other"):
        arm.steps(first_step, steps)
    return {label: t / steps for label, t in clock.own.items()}, sum(clock.own.values()) / steps


def profile_report(loop_split: dict, loop_total: float, model_split: dict, model_total: float) -> str:
    labels = sorted({*loop_split, *model_split}, key=lambda p: -max(loop_split.get(p, 0), model_split.get(p, 0)))
    rows = [_part_row(part, loop_split.get(part, 0.0), loop_total, model_split.get(part, 0.0)) for part in labels]
    rows.append(_part_row("the whole step", loop_total, loop_total, model_total))
    columns = ["part (own time)", "loop ms/step", "share of the loop step", "model step ms/step", "loop - model ms"]
    return markdown_table(columns, rows)


def _part_row(part: str, loop_s: float, loop_total: float, model_s: float) -> list[str]:
    share = f"{100 * loop_s / loop_total:.1f} %"
    return [part, f"{1e3 * loop_s:.2f}", share, f"{1e3 * model_s:.2f}", f"{1e3 * (loop_s - model_s):+.2f}"]


def run(args: argparse.Namespace) -> None:
    bench = from_flags(LoopBench, args)
    if bench.rounds < 1 or bench.warmup < 0 or bench.steps < 0 or bench.threads < 0:
        raise UserError("--rounds must be >= 1, --warmup, --steps and --threads >= 0")
    if bench.threads:
        torch.set_num_threads(bench.threads)
    from moe_lm.parallel.deepspeed_setup import init_distributed, shutdown_distributed

    init_distributed()  # a world of one, as `moe-lm train` starts
    try:
        with tempfile.TemporaryDirectory(prefix="moe-lm-bench-loop-") as tmp:
            print(measure(bench, Path(tmp)))
    finally:
        shutdown_distributed()  # why: as the training command, so that the process can train (or bench) again


def measure(bench: LoopBench, tmp: Path) -> str:
    """The interleaved timing's table (or with `--profile` the parts'), after a line naming the batch."""
    reference = bench_config(bench.config, bench.overrides)
    steps = bench.steps or reference.cadence.log_interval
    windows = random_windows(reference)
    model = ModelStep(reference, windows)
    loops = [LoopStep(f"loop ({spec or 'the config'})", bench_config(bench.config, [*bench.overrides, *spec.split()]),
                      windows, tmp / str(i)) for i, spec in enumerate(bench.arms)]  # fmt: skip
    if bench.before:
        from moe_lm.bench.loop_before import LoopBefore

        loops.append(LoopBefore("loop before issue 65 (the config)", reference, windows, tmp / "before"))
    t = reference.train
    head = (f"{bench.config}: {t.grad_accum_steps} x {t.micro_batch_size} x {t.seq_len} tokens per optimizer step, "
            f"{steps} steps per arm and round, {torch.get_num_threads()} threads")  # fmt: skip
    if bench.profile:
        profiled = [loops[0], loops[-1]] if bench.before else loops[:1]  # the first arm, and the loop as it was
        return "\n".join([head, *(profile(model, loop, bench.warmup, steps, bench.clock) for loop in profiled)])
    stats = time_steps([model, *loops], bench.rounds, bench.warmup, steps, bench.clock)
    return f"{head}, {bench.clock} time\n{table([model, *loops], stats, steps)}"


def profile(model: ModelStep, loop: LoopStep, warmup: int, steps: int, clock: str = "wall") -> str:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else _no_sync
    for r in range(warmup):
        model.steps(r * steps, steps)
        loop.steps(r * steps, steps)
    first = warmup * steps
    loop_split, loop_total = profile_parts(loop, loop_parts(loop), first, steps, sync, clock)
    model_split, model_total = profile_parts(model, model_parts(model), first, steps, sync, clock)
    title = f"{loop.name}: the parts of {steps} steps after {warmup} x {steps} warm-up steps, {clock} time:"
    return f"{title}\n{profile_report(loop_split, loop_total, model_split, model_total)}"
