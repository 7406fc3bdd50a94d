"""The folders moe-lm writes, and the rule that keeps it out of everything else.

A command that writes a folder (`export`, `analyze`, `ablate`, `eval`, `experiment`'s report, `prepare`) writes it
whole into a fresh hidden sibling, `.<name>.partial-<host>-<pid>`, and renames it into place at the end. So an
interrupted or failed command leaves no folder that looks complete: it removes its partial sibling itself, and one
left by a kill is removed by the next command into the same folder. Nothing is written through the old folder, so
a symlink in it is never followed. A finished folder holds MARKER (the command that wrote it and the files it
wrote, each with its size and content hash).

What a command may replace: a new path, an empty folder, or an earlier output of the same command (its marker says
so). Anything else only with `--force`, and then the old folder is moved aside to `<name>.prev-<time>`, never
deleted. An earlier output is deleted only when every file in it is one its marker records, with the size and hash
it was written with; a file the user added or changed (or a marker without hashes) keeps the whole old folder,
moved aside, and the message names those files. The folder itself may not be a symlink or a mount point, and may
not lie inside a run folder or a prepared data folder: moe-lm moves or replaces those whole, and a data folder
refuses files it did not make.

A staging folder is a lock: its writer holds an flock on the folder's marker from before the marker has its name
until the folder is renamed into place. So one is swept as stale only when that lock can be taken (its writer is
gone), and it is renamed out of the way under the lock before it is removed: a live writer's folder is never swept.
Markers and pointers are read only when they are small regular files: a FIFO or a device put in their place is not
waited on.

A run folder (`train.out_dir`) is written in place while training; it is a folder `moe-lm train` created (MARKER)
or a new or empty one (moe_lm/train/run_folder.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from moe_lm.compat import old_form
from moe_lm.errors import UserError
from moe_lm.files import HASH, disk_full, file_hash, gib, read_small, size_of, some

MARKER = ".moe-lm.json"
PARTIAL = ".partial-"  # in the staging folder's name: .<name>.partial-<host>-<pid>
# written in place or replaced whole (a pruned run, moe_lm/pruning/run.py, replaced whole by `moe-lm prune` only)
FOLDER_KINDS = {"train": "run folder", "prepare": "prepared data folder", "prune": "pruned run folder"}


def read_marker(folder: Path) -> dict | None:
    """`folder`'s marker when it is one moe-lm wrote: a small regular file (not a link), a JSON mapping whose
    `command` is a string. None otherwise: such a marker proves nothing."""
    text = read_small(folder / MARKER, follow=False)
    try:
        record = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("command"), str) else None


def made_by(folder: Path) -> str | None:
    """The moe-lm command that made `folder` (its marker), or None for a folder moe-lm did not make. A run folder
    from before the marker counts only when everything in it is what a run holds (`legacy_run`)."""
    record = read_marker(folder)
    if record is not None:
        return record["command"]
    if os.path.lexists(folder / MARKER):
        return None  # a marker that proves nothing
    if legacy_run(folder):
        old_form(f"the run folder {folder} (no {MARKER})", "train on it with moe-lm 0.2 once, which adds the marker")
        return "train"
    if (folder / "meta.json").is_file() and (folder / "train").is_dir() and (folder / "val").is_dir():
        return "prepare"
    return None


# What `moe-lm train` and the experiment runner put in a run folder (before run folders carried a marker)
RUN_ENTRIES = {"config.yaml", "metrics.jsonl", "checkpoints", "wandb", "wandb_id", "tb", ".lock", "launch.yaml",
               "train.log", "experiment_run.json", "final_eval.json"}  # fmt: skip
# in checkpoints/: save's folders and pointer, and the scripts DeepSpeed puts beside them
CHECKPOINT_ENTRY = re.compile(r"step_\d{8}|latest|latest\.tmp|zero_to_fp32\.py|zero_to_torch\.py")


def legacy_run(folder: Path) -> bool:
    """Whether `folder`, which has no marker, is a run `moe-lm train` wrote before runs were marked: a log or a
    checkpoint pointer, nothing but what a run holds, metrics rows as the loop writes them, checkpoint folders
    named as a save names them. why this strict: another trainer's folder also holds a config.yaml and a
    metrics.jsonl, and taking it for a run would write into it."""
    metrics, checkpoints = folder / "metrics.jsonl", folder / "checkpoints"
    if not (metrics.is_file() or (checkpoints / "latest").is_file()):
        return False
    try:
        if not {p.name for p in folder.iterdir()} <= RUN_ENTRIES:
            return False
        if checkpoints.is_dir() and not all(CHECKPOINT_ENTRY.fullmatch(p.name) for p in checkpoints.iterdir()):
            return False
    except OSError:
        return False
    if (checkpoints / "latest").is_file() and not CHECKPOINT_ENTRY.fullmatch(
        (read_small(checkpoints / "latest") or "-").strip()
    ):
        return False
    if metrics.is_file():
        first = (read_small(metrics, limit=1 << 16, head=True) or "").partition("\n")[0]
        try:
            row = json.loads(first) if first.strip() else {"kind": "train", "step": 0}
        except ValueError:
            return False
        if not (isinstance(row, dict) and isinstance(row.get("kind"), str) and isinstance(row.get("step"), int)):
            return False
    return True


def written_record(folder: Path) -> dict[str, dict]:
    """What a command wrote into `folder`: {relative path: {"bytes", "xxh3_128"}} per file, {"link": target} per
    symlink (the marker itself left out)."""
    record = {}
    for p in sorted(folder.rglob("*")):
        name = str(p.relative_to(folder))
        if name == MARKER:
            continue
        if p.is_symlink():
            record[name] = {"link": os.readlink(p)}
        elif p.is_file():
            record[name] = {"bytes": p.stat().st_size, HASH: file_hash(p)}
    return record


def unchanged(path: Path, entry) -> bool:
    """Whether `path` is still what a marker's `entry` records (`written_record`)."""
    if not isinstance(entry, dict):
        return False
    if "link" in entry:
        return path.is_symlink() and os.readlink(path) == entry["link"]
    return (
        not path.is_symlink()
        and path.is_file()
        and path.stat().st_size == entry.get("bytes")
        and file_hash(path) == entry.get(HASH)
    )


def write_marker(folder: Path, command: str, files: dict[str, dict] | None = None) -> None:
    record = {"command": command, "written_by": f"moe-lm {command}"}
    if files is not None:
        record["files"] = files
    (folder / MARKER).write_text(json.dumps(record, indent=1) + "\n")


def enclosing_folder(path: Path) -> tuple[Path, str] | None:
    """The nearest run or data folder that `path` lies inside (not `path` itself), with its kind."""
    for parent in path.resolve().parents:
        kind = FOLDER_KINDS.get(made_by(parent) or "")
        if kind:
            return parent, kind
    return None


def moved_aside(folder: Path) -> Path:
    """`folder` renamed to `<name>.prev-<time>` beside it (a new name if that exists); nothing is deleted."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = folder.with_name(f"{folder.name}.prev-{stamp}"), 1
    while aside.exists() or aside.is_symlink():
        aside, n = folder.with_name(f"{folder.name}.prev-{stamp}-{n}"), n + 1
    os.rename(folder, aside)
    return aside


class OutputFolder:
    """The folder `path` that `command` writes, checked at once (before anything slow runs); `staged()` gives the
    folder to write into and puts it in place when the block ends without an error. `say` prints what was moved."""

    def __init__(
        self, path: str | Path, command: str, force: bool = False, flag: str = "--out", say=print, file: bool = False
    ):
        """`file`: `path` is one file (`export --gguf`), written in the staging folder and renamed into place; an
        existing file is replaced only with `force` (moved aside)."""
        self.path, self.command, self.force, self.flag, self.say = Path(path), command, force, flag, say
        self.file = file
        self.stage: Path | None = None
        self.check()

    def _refuse(self, why: str) -> UserError:
        named = f"{self.flag}{self.path}" if self.flag.endswith("=") else f"{self.flag} {self.path}"
        return UserError(f"{named}: {why}")

    def check(self) -> None:
        """Refuse a path the command may not write, with what to do; nothing is created or deleted here."""
        path = self.path
        if path.is_symlink():
            raise self._refuse("is a symlink; give the real folder (moe-lm does not write through links)")
        cwd = Path.cwd().resolve()  # why: `.` or `..` has no name to write beside, and moving it aside moves us
        if path.exists() and (path.resolve() == cwd or path.resolve() in cwd.parents):
            raise self._refuse("is the current folder or holds it; give a folder of its own (e.g. a new subfolder)")
        if path.exists() and os.path.ismount(path):  # why: the rename into place cannot replace a mount point
            raise self._refuse(f"is a mount point; give a new folder inside it (e.g. {path / 'out'})")
        if self.file and path.is_dir():
            raise self._refuse("is a folder; give a file path")
        if self.file and path.exists() and not self.force:
            raise self._refuse(f"exists; give a new file, or --force to move it aside to {path.name}.prev-<time> "
                               "(nothing is deleted)")  # fmt: skip
        if not self.file and path.exists() and not path.is_dir():
            raise self._refuse("exists and is not a folder; give a folder path")
        inside = enclosing_folder(path)
        if inside:
            folder, kind = inside
            raise self._refuse(f"lies inside the {kind} {folder}, which moe-lm moves or replaces whole; give a folder "
                               "outside it")  # fmt: skip
        owner = made_by(path) if path.is_dir() else None
        if owner in FOLDER_KINDS and owner != self.command:
            raise self._refuse(f"is a {FOLDER_KINDS[owner]}; give another folder (nothing was written)")
        if path.is_dir() and owner != self.command and any(path.iterdir()) and not self.force:
            shown = some(sorted(p.name for p in path.iterdir()))
            raise self._refuse(
                f"holds files that moe-lm {self.command} did not write ({shown}); give a new or empty folder, or "
                f"--force to move that folder aside to {path.name}.prev-<time> (nothing was deleted)"
            )
        for other in self._partials():
            if self._writer_alive(other):
                raise self._busy(other)

    def _busy(self, other: Path) -> UserError:
        host, _, pid = other.name.rpartition(PARTIAL)[2].rpartition("-")
        return self._refuse(
            f"is being written by another moe-lm process (pid {pid} on {host}: {other}); wait for it, or stop it and "
            "run again (remove that folder by hand if its process is gone)"
        )

    def _partials(self) -> list[Path]:
        """Other processes' staging folders of this path (ours by name and marker)."""
        parent, prefix = self.path.parent, f".{self.path.name}{PARTIAL}"
        if not parent.is_dir():
            return []
        return sorted(p for p in parent.iterdir() if p.name.startswith(prefix) and read_marker(p) is not None)

    @staticmethod
    def _writer_alive(stage: Path) -> bool:
        """Whether the process writing `stage` is alive: it holds its marker's lock (another host's: assumed)."""
        host = stage.name.rpartition(PARTIAL)[2].rpartition("-")[0]
        if host != socket.gethostname():
            return True
        lock = _try_lock(stage / MARKER)
        if lock is None:
            return True
        os.close(lock)
        return False

    def _sweep(self) -> None:
        """Remove the staging folders of writers that are gone (refusing when one is alive). Each is renamed out of
        the way while its lock is held, so no writer can be working in what is removed."""
        for other in self._partials():
            host = other.name.rpartition(PARTIAL)[2].rpartition("-")[0]
            lock = _try_lock(other / MARKER) if host == socket.gethostname() else None
            if lock is None:
                raise self._busy(other)
            try:
                gone = other.with_name(f"{other.name.replace(PARTIAL, '.stale-')}-{os.getpid()}")
                os.rename(other, gone)
            except OSError:  # another process swept it first
                continue
            finally:
                os.close(lock)
            shutil.rmtree(gone, ignore_errors=True)

    def _make_stage(self) -> tuple[Path, int]:
        """This process's staging folder with its marker, locked before the marker has its name."""
        stage = self.path.parent / f".{self.path.name}{PARTIAL}{socket.gethostname()}-{os.getpid()}"
        stage.mkdir()
        draft = stage / (MARKER + ".new")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, json.dumps({"command": self.command, "written_by": f"moe-lm {self.command}"}).encode())
            os.rename(draft, stage / MARKER)  # why renamed: the marker appears already locked
        except OSError:
            os.close(fd)
            raise
        return stage, fd

    @contextlib.contextmanager
    def staged(self, needed_bytes: int | None = None) -> Iterator[Path]:
        """The staging folder to write into; at a clean exit it becomes `path`. On an error (a full disk included)
        the staging folder and the parents this made are removed and nothing else is touched; a full disk is
        reported in one line with the space needed. `needed_bytes`: checked against the free space first."""
        self.check()  # again: the work before may have taken minutes
        made = [p for p in reversed(self.path.absolute().parents) if not p.exists()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._refuse(f"cannot create its parent folder ({e.strerror}); give a writable place") from None
        self._sweep()
        try:
            stage, lock = self._make_stage()
        except OSError as e:
            shutil.rmtree(self.path.parent / f".{self.path.name}{PARTIAL}{socket.gethostname()}-{os.getpid()}",
                          ignore_errors=True)  # fmt: skip
            _remove_empty(made)
            raise self._refuse(f"cannot write beside it in {self.path.parent} ({e.strerror}); give a writable "
                               "place") from None  # fmt: skip
        self.stage = stage
        try:
            free = shutil.disk_usage(stage).free
            if needed_bytes and needed_bytes > free:
                shutil.rmtree(stage, ignore_errors=True)
                _remove_empty(made)
                raise self._refuse(f"needs about {gib(needed_bytes)} and {gib(free)} is free there; free space or "
                                   "give another disk (nothing was written)")  # fmt: skip
            try:
                yield stage / self.path.name if self.file else stage
                if self.file:
                    self._put_file_in_place(stage)
                    return
                write_marker(stage, self.command, written_record(stage))
                self._put_in_place(stage)
            except BaseException as e:
                written = size_of(stage) if stage.exists() else 0
                free = shutil.disk_usage(stage).free if stage.exists() else 0
                shutil.rmtree(stage, ignore_errors=True)
                _remove_empty(made)
                if disk_full(e):
                    need = f"about {gib(needed_bytes)}" if needed_bytes else f"more than {gib(written)}"
                    raise self._refuse(
                        f"the disk filled up while writing it ({gib(written)} written, {gib(free)} free, {need} "
                        "needed); nothing was left behind. Free space or give another disk, then run the same command"
                    ) from None
                raise
        finally:
            os.close(lock)

    def _put_file_in_place(self, stage: Path) -> None:
        if self.path.exists():
            self.say(f"moved the file that was at {self.path} to {moved_aside(self.path)} (nothing was deleted)")
        os.rename(stage / self.path.name, self.path)
        shutil.rmtree(stage)

    def _put_in_place(self, stage: Path) -> None:
        path = self.path
        old = None
        if path.is_dir() and any(path.iterdir()):
            old = moved_aside(path)
        elif path.is_dir():
            path.rmdir()  # empty: nothing to keep
        os.rename(stage, path)
        if old is None:
            return
        if made_by(old) != self.command:
            self.say(f"moved the folder that was at {path} to {old} (nothing was deleted)")
        elif why := _remove_if_unchanged(old):
            self.say(f"moved the earlier output that was at {path} to {old} (nothing was deleted: {why})")

    def final(self, written: Path) -> Path:
        """Where a path written inside the staging folder is once the folder is in place (for messages)."""
        return self.path / Path(written).relative_to(self.stage)


def _remove_if_unchanged(old: Path) -> str | None:
    """Delete an earlier output when every file in it is one its marker records, unchanged (None); otherwise keep
    it whole and say why: the files added or changed since, or that its marker records no hashes."""
    files = (read_marker(old) or {}).get("files")
    if not isinstance(files, dict):  # a marker from before the hashes (a list of names) proves no content
        return "its marker, from an earlier moe-lm, records no sizes or hashes"
    present = sorted(str(p.relative_to(old)) for p in old.rglob("*") if p.is_file() or p.is_symlink())
    changed = [name for name in present if name != MARKER and not unchanged(old / name, files.get(name))]
    if changed:
        return f"changed or added since it was written: {some(changed)}"
    shutil.rmtree(old)  # every file is as we wrote it; rmtree removes symlinks themselves, never what they point to
    return None


def _try_lock(path: Path) -> int | None:
    """An exclusive flock on `path` when nobody holds one (the descriptor, to close), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _remove_empty(folders: list[Path]) -> None:
    for folder in reversed(folders):
        with contextlib.suppress(OSError):
            folder.rmdir()
