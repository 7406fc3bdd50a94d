"""The run folder of a training process: one process per folder, and nothing of an earlier run lost.

<run>/.lock     held (flock) by rank 0 for the life of the run; says "pid N on HOST" for the error message
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from pathlib import Path

from moe_lm.checkpoint.format import ckpt_root
from moe_lm.checkpoint.save_resume import barrier, rank
from moe_lm.errors import RunError


@contextlib.contextmanager
def run_folder(run_dir: Path, resume: bool, log):
    """The run folder of this training process. Rank 0 creates it and holds a lock on it, so a second process on
    the same folder is refused before it touches anything. Not resuming, an existing run is moved aside to
    <run>.prev-<time> (nothing is deleted). A folder this process created is removed again if training fails
    before it wrote any metric or checkpoint."""
    created, lock = not run_dir.exists(), None
    if rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = _lock(run_dir)
        if not resume and (ckpt_root(run_dir).is_dir() or (run_dir / "metrics.jsonl").is_file()):
            aside = run_dir.with_name(f"{run_dir.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
            shutil.move(str(run_dir), str(aside))
            log(f"train.resume=false: moved the previous run to {aside}")
            lock.close()
            run_dir.mkdir(parents=True)
            created, lock = True, _lock(run_dir)
    barrier()
    try:
        yield
    except BaseException:
        nothing_written = not ckpt_root(run_dir).exists() and not (run_dir / "metrics.jsonl").exists()
        if lock is not None and created and nothing_written:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.close()


def _lock(run_dir: Path):
    path = run_dir / ".lock"
    handle = open(path, "a+")  # noqa: SIM115 - held for the life of the run
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise RunError(
            f"{run_dir} is in use by another training process ({holder}); wait for it to finish, stop it, or pick "
            "another train.out_dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {os.uname().nodename}")
    handle.flush()
    return handle
