"""Where metrics and messages go: console lines, <run>/metrics.jsonl, wandb (offline by default) and TensorBoard
(<run>/tb/, when logging.tensorboard is on). Rank 0 only."""

from __future__ import annotations

import json
import math
import time
import uuid
from pathlib import Path

import numpy as np

from moe_lm.config import Config, LoggingConfig, config_to_dict
from moe_lm.console import verbose
from moe_lm.errors import MissingExtra, require


class Tracker:
    """Rank 0's output: `info` messages at once; `start(step)` opens metrics.jsonl and wandb for the run, which
    `finish` (or leaving the `with` block) closes."""

    def __init__(self, cfg: Config, run_dir: Path, enabled: bool) -> None:
        self.cfg, self.run_dir, self.enabled = cfg, run_dir, enabled
        self.path = run_dir / "metrics.jsonl"
        self.max_steps = cfg.train.max_steps
        self.t0, self.start_step, self.wandb, self.tb = time.time(), 0, None, None

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def start(self, step: int) -> None:
        """Begin logging at `step` (0: a new run): rows an interrupted run logged past its checkpoint are dropped."""
        self.t0, self.start_step = time.time(), step
        if not self.enabled:
            return
        _truncate_after(self.path, step, self.info)
        try:
            self.wandb = open_wandb(self.cfg.logging, self.run_dir, config=config_to_dict(self.cfg))
        except MissingExtra as e:  # why not an error: a plain run needs no wandb, metrics.jsonl has every row
            self.info(f"note: {e} (or set logging.wandb_mode=disabled); this run logs to {self.path} only")
        if self.cfg.logging.tensorboard:
            self.tb = open_tensorboard(self.run_dir, step)

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
            self._to_wandb(lambda: self.wandb.log(data, step=row["step"]))
        if self.tb is not None:
            _log_tensorboard(self.tb, row, histograms or {})

    def console(self, line: str, step: int) -> None:
        if not self.enabled:
            return
        done = step - self.start_step
        elapsed = time.time() - self.t0
        eta = elapsed / done * (self.max_steps - step) if done > 0 else math.nan
        pct = 100 * step / self.max_steps
        print(f"[{pct:5.1f}% {_fmt_time(elapsed)}<{_fmt_time(eta)}] {line}", flush=True)

    def _to_wandb(self, call) -> None:
        """`call` on wandb; if wandb's service is gone (killed with the terminal's Ctrl-C, say, or by a launcher
        that terminates every process below a rank), say so once and go on without it. why not an error: the run
        must still reach its checkpoint, and metrics.jsonl has every row."""
        try:
            call()
        except Exception as e:  # noqa: BLE001 - wandb's service errors come as many types (broken pipe, timeouts)
            self.wandb = None
            self.info(f"warning: wandb stopped logging ({type(e).__name__}: {str(e)[:120]}); {self.path} has every row")

    def finish(self) -> None:
        if self.wandb is not None:
            self._to_wandb(self.wandb.finish)
            self.wandb = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.finish()


def open_wandb(log_cfg: LoggingConfig, run_dir: Path, config: dict | None = None, create: bool = True):
    """The run's wandb run, resumed by the id in <run>/wandb_id (a new id if `create`); None when wandb is disabled
    or the run has no id. The same run receives training metrics and, later, the routing report's figures."""
    id_file = run_dir / "wandb_id"
    if log_cfg.wandb_mode == "disabled" or not (create or id_file.is_file()):
        return None
    wandb = require("wandb", "wandb", f"logging.wandb_mode={log_cfg.wandb_mode}")

    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id)
    wandb.init(
        project=log_cfg.wandb_project,
        name=log_cfg.run_name or run_dir.name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        mode=log_cfg.wandb_mode,
        config=config,
        settings=wandb.Settings(silent=not (log_cfg.verbose or verbose())),
    )
    return wandb


def open_tensorboard(run_dir: Path, step: int):
    """A SummaryWriter on <run>/tb/. Resuming at `step` purges what an interrupted run logged past it, as
    metrics.jsonl drops those rows."""
    require("tensorboard", "tensorboard", "logging.tensorboard=true")
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(run_dir / "tb"), purge_step=step + 1 if step else None)


def _log_tensorboard(tb, row: dict, histograms: dict[str, np.ndarray]) -> None:
    """The row's numbers under the tags wandb uses (`train/loss`, `eval/loss/<domain>`), and each expert-load
    histogram with one bucket per expert."""
    step = row["step"]
    for key, value in row.items():
        if key not in ("kind", "step") and isinstance(value, int | float):  # flags (bool) as 0/1
            tb.add_scalar(f"{row['kind']}/{key}", float(value), step)
    for name, counts in histograms.items():
        counts = np.asarray(counts, dtype=np.float64)
        experts = np.arange(len(counts), dtype=np.float64)
        tb.add_histogram_raw(
            name, min=0.0, max=float(len(counts) - 1), num=float(counts.sum()), sum=float(counts @ experts),
            sum_squares=float(counts @ experts**2), bucket_limits=(experts + 0.5).tolist(),
            bucket_counts=counts.tolist(), global_step=step,
        )  # fmt: skip


def _truncate_after(path: Path, step: int, warn) -> None:
    """Keep the rows of steps <= step. A half-written last line (a kill mid-write) is dropped with a warning;
    an unreadable line elsewhere is kept as it is and named."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = []
    for i, line in enumerate(lines):
        try:
            row_step = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            if i == len(lines) - 1:
                warn(f"warning: {path}: dropped a half-written last line ({line[:60]!r}...)")
                continue
            warn(f"warning: {path} line {i + 1} is not a metrics row; kept as it is")
            kept.append(line)
            continue
        if row_step <= step:
            kept.append(line)
    path.write_text("".join(r + "\n" for r in kept))


def _fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"
