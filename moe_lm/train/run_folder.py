"""The run folder of a training process: one process per folder, and nothing of an earlier run lost.

<run>/.lock          held (flock) by rank 0 for the life of the run; says "pid N on HOST" for the error message
<run>/.moe-lm.json   the marker: this folder is a run that moe-lm train made (moe_lm/output_folder.py). A folder
                     without it is a run only if it is new or empty, or a run from before the marker, checked entry
                     by entry (`legacy_run`); any other folder is refused before anything is written.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from pathlib import Path

from moe_lm.checkpoint.format import ckpt_root
from moe_lm.checkpoint.save_resume import barrier, everywhere, rank
from moe_lm.errors import RunError
from moe_lm.files import some
from moe_lm.output_folder import FOLDER_KINDS, enclosing_folder, made_by, write_marker

LOCK = ".lock"


@contextlib.contextmanager
def run_folder(run_dir: Path, resume: bool, log):
    """The run folder of this training process. Rank 0 creates it and holds a lock on it, so a second process on
    the same folder is refused before it touches anything. Not resuming, an existing run is moved aside to
    <run>.prev-<time> (nothing is deleted). A folder that is not a run is refused before anything is written
    (check_run_folder). A folder this process created is removed again if training fails before it wrote any
    metric or checkpoint, and an empty one it was given is emptied again."""
    created, lock = not run_dir.exists(), None
    was_empty = created or (run_dir.is_dir() and not any(run_dir.iterdir()))
    refused = None
    if rank() == 0:
        try:
            check_run_folder(run_dir)  # why before mkdir: a folder that is not a run gets nothing written into it
        except RunError as e:
            refused = e
    if not everywhere(refused is None):  # why agreed: the other ranks would wait for rank 0 at the barrier below
        raise refused or RunError(f"rank 0 refused train.out_dir={run_dir} (its message says why)")
    if rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = _lock(run_dir)
        if made_by(run_dir) != "train":
            write_marker(run_dir, "train")
        if not resume and (ckpt_root(run_dir).is_dir() or (run_dir / "metrics.jsonl").is_file()):
            aside = run_dir.with_name(f"{run_dir.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
            shutil.move(str(run_dir), str(aside))
            log(f"train.resume=false: moved the previous run to {aside}")
            lock.close()
            run_dir.mkdir(parents=True)
            created, was_empty, lock = True, True, _lock(run_dir)
            write_marker(run_dir, "train")
    barrier()
    try:
        yield
    except BaseException:
        nothing_written = not ckpt_root(run_dir).exists() and not (run_dir / "metrics.jsonl").exists()
        if lock is not None and was_empty and nothing_written:
            lock.close()
            lock = None
            if created:
                shutil.rmtree(run_dir, ignore_errors=True)
            else:  # the user's empty folder: empty it again (all in it is this start's: config, marker, wandb)
                for p in run_dir.iterdir():
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink()
        raise
    finally:
        if lock is not None:
            lock.close()


def check_run_folder(run_dir: Path) -> None:
    """Refuse a train.out_dir that is not a run: a non-empty folder moe-lm train did not make, a file, or a folder
    inside a run or data folder."""
    if run_dir.is_symlink() and not run_dir.exists():
        raise RunError(
            f"train.out_dir={run_dir} is a symlink to {os.readlink(run_dir)}, which does not exist; create that "
            "folder, or give a folder path"
        )
    inside = enclosing_folder(run_dir)
    if inside:
        raise RunError(f"train.out_dir={run_dir} lies inside the {inside[1]} {inside[0]}; give a folder outside it")
    if run_dir.exists() and not run_dir.is_dir():
        raise RunError(f"train.out_dir={run_dir} exists and is not a folder; give a folder path")
    owner = made_by(run_dir) if run_dir.is_dir() else None
    # why .lock aside: a starting run holds it a moment before its marker is down; _lock then names the holder
    names = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK) if run_dir.is_dir() else []
    if owner != "train" and names:
        what = (
            f"is a {FOLDER_KINDS[owner]}"
            if owner in FOLDER_KINDS
            else f"holds files that are not a run ({some(names)})"
        )
        raise RunError(
            f"train.out_dir={run_dir} {what}; nothing was written there. Give a new or empty folder (a run folder is "
            "one moe-lm train made)"
        )


def _lock(run_dir: Path):
    path = run_dir / LOCK
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
