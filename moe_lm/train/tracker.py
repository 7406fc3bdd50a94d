"""Where metrics go: console lines, <run>/metrics.jsonl, and wandb (offline by default). Rank 0 only."""

from __future__ import annotations

import json
import math
import time
import uuid
from pathlib import Path

import numpy as np

from moe_lm.config import Config, LoggingConfig, config_to_dict


class Tracker:
    def __init__(self, cfg: Config, run_dir: Path, resume_step: int, enabled: bool) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.max_steps = cfg.train.max_steps
        self.t0 = time.time()
        self.start_step = resume_step
        self.wandb = None
        if not enabled:
            return
        if resume_step == 0:
            self.path.unlink(missing_ok=True)
        else:
            _truncate_after(self.path, resume_step)  # drop rows an interrupted run logged past its checkpoint
        self.wandb = _init_wandb(cfg.logging, cfg, run_dir)

    def log(self, row: dict, histograms: dict[str, np.ndarray] | None = None) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            data = {f"{row['kind']}/{k}": v for k, v in row.items() if k not in ("kind", "step")}
            for name, counts in (histograms or {}).items():
                # one bar per expert: the histogram's bins are the experts, heights are token-slots
                data[name] = self.wandb.Histogram(np_histogram=(counts, np.arange(len(counts) + 1)))
            self.wandb.log(data, step=row["step"])

    def console(self, line: str, step: int) -> None:
        if not self.enabled:
            return
        done = step - self.start_step
        elapsed = time.time() - self.t0
        eta = elapsed / done * (self.max_steps - step) if done > 0 else math.nan
        pct = 100 * step / self.max_steps
        print(f"[{pct:5.1f}% {_fmt_time(elapsed)}<{_fmt_time(eta)}] {line}", flush=True)

    def finish(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def _init_wandb(log_cfg: LoggingConfig, cfg: Config, run_dir: Path):
    if log_cfg.wandb_mode == "disabled":
        return None
    import wandb

    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id)
    wandb.init(
        project=log_cfg.wandb_project,
        name=log_cfg.run_name or run_dir.name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        mode=log_cfg.wandb_mode,
        config=config_to_dict(cfg),
    )
    return wandb


def _truncate_after(path: Path, step: int) -> None:
    if not path.is_file():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(r + "\n" for r in rows))


def _fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"
