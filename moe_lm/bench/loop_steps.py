"""The two arms of `moe-lm bench loop` (moe_lm/bench/loop.py): the model step and the training loop's step, over the
same micro-batches of one random token stream."""

from __future__ import annotations

import contextlib
import io
import types
from pathlib import Path

import numpy as np
import torch

from moe_lm.bench.arms import Arm
from moe_lm.config import Config, load_config, preset_path
from moe_lm.data.batches import TrainWindows
from moe_lm.errors import UserError

NEVER = 10**9  # a step number no bench round reaches: no evaluation, no last step


def bench_config(config: str, overrides: list[str]) -> Config:
    """The config as `moe-lm train` would read it, with neither evaluation nor checkpoints nor wandb in the rounds."""
    fixed = ["logging.wandb_mode=disabled", "cadence.ckpt_interval=0", f"cadence.eval_interval={NEVER}",
             f"train.max_steps={NEVER}"]  # fmt: skip
    cfg = load_config(preset_path(config), [*overrides, *fixed])
    if cfg.parallel.pp_size > 1:
        raise UserError("parallel.pp_size > 1: the model step has no pipeline stages to compare with")
    return cfg


def random_windows(cfg: Config) -> TrainWindows:
    """The training loop's window stream over random tokens (the loop's own sampling, no corpus needed)."""
    t = cfg.train
    n = max(64, 4 * cfg.global_batch(1)) * t.seq_len + 1
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, n, dtype=np.int64)
    return TrainWindows(types.SimpleNamespace(tokens=tokens), t.seq_len, cfg.seed)


class ModelStep:
    """`moe-lm bench train`'s step (model + fused AdamW, no DeepSpeed) over the loop's micro-batches."""

    def __init__(self, cfg: Config, windows: TrainWindows) -> None:
        from moe_lm.parallel.deepspeed_setup import device, use_bf16

        self.dev = device()
        dtype = torch.bfloat16 if use_bf16(cfg.parallel, self.dev) else torch.float32
        self.name, self.cfg, self.windows = "model step", cfg, windows
        self.arm = Arm(self.name, cfg, str(self.dev), dtype)

    def steps(self, first_step: int, n: int) -> None:
        t, arm = self.cfg.train, self.arm
        for step in range(first_step, first_step + n):
            for m in range(t.grad_accum_steps):
                start = step * self.cfg.global_batch(1) + m * t.micro_batch_size
                batch = self.windows.batch(start, t.micro_batch_size).to(self.dev)
                # why divided: DeepSpeed's backward scales each micro-batch's loss by 1 / grad_accum_steps
                (arm.loss(arm.forward(batch), batch) / t.grad_accum_steps).backward()
            arm.update()


class LoopStep:
    """The training loop's step (`loop._step`) on the engine `moe-lm train` builds, in a temporary run folder."""

    def __init__(self, name: str, cfg: Config, windows: TrainWindows, folder: Path) -> None:
        from moe_lm.parallel.deepspeed_setup import device
        from moe_lm.train import loop
        from moe_lm.train.objective import objective_for
        from moe_lm.train.stop import StopOnSignal, WatchPeers
        from moe_lm.train.tracker import Tracker

        self.name, self.cfg, self._step = name, cfg, loop._step
        quiet = lambda message: None  # noqa: E731 - start-up notes are not the benchmark's output
        model, _, engine, compiled = loop.build_trainee(cfg, None, quiet)
        folder.mkdir(parents=True, exist_ok=True)
        tracker = Tracker(cfg, folder, enabled=True)  # rank 0's: metrics.jsonl and the console line
        tracker.start(0)
        self.run = loop._Run(
            cfg=cfg, run_dir=folder, tracker=tracker, windows=windows, engine=engine, model=model,
            objective=objective_for(cfg), throughput=loop.run_throughput(cfg, 1, device(), quiet),
            evaluate=_no_evaluation, watch=WatchPeers([], folder), rank=0, world=1, dp_rank=0, dp_size=1,
            pipeline=None, compiled=compiled,
        )  # fmt: skip
        self.stop = StopOnSignal()  # not entered: no handler installed, `requested` still asks every rank

    def steps(self, first_step: int, n: int) -> None:
        G = self.run.global_batch
        with contextlib.redirect_stdout(io.StringIO()):  # the logged row's console line
            for step in range(first_step, first_step + n):
                self._step(self.run, step, step * G, NEVER, self.stop)


def _no_evaluation(step: int) -> dict:
    raise AssertionError(f"the benchmark's config evaluates at step {step}")
