"""Learning-rate schedules: linear warmup, then cosine or warmup-stable-decay (WSD) down to min_lr."""

from __future__ import annotations

import math

from moe_lm.config import OptimConfig


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
