"""Schedules over optimizer steps: the learning rate (linear warmup, then cosine or warmup-stable-decay down to
min_lr) and the MTP loss weight."""

from __future__ import annotations

import math

from moe_lm.config import MTPConfig, OptimConfig


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based) in a run of `max_steps`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps)
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))
    decay_start = max_steps - int(cfg.decay_fraction * max_steps)
    if step < decay_start:
        return cfg.lr
    progress = (step - decay_start) / max(1, max_steps - decay_start)
    return cfg.lr + (cfg.min_lr - cfg.lr) * min(1.0, progress)


def mtp_weight_at(step: int, cfg: MTPConfig, max_steps: int) -> float:
    """The MTP loss weight lambda at optimizer step `step` (0-based): loss_weight, then late_loss_weight from
    `late_start` on (a fraction of max_steps if <= 1, else a step number; 0 = never), as DeepSeek-V3's 0.3 -> 0.1."""
    if cfg.depth == 0:
        return 0.0
    if cfg.late_start <= 0:
        return cfg.loss_weight
    switch = cfg.late_start * max_steps if cfg.late_start <= 1 else cfg.late_start
    return cfg.late_loss_weight if step >= switch else cfg.loss_weight
