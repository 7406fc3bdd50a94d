"""The folders moe-lm writes, and the rule that keeps it out of everything else.

A command that writes a folder (`export`, `analyze`, `ablate`, `eval`, `experiment`'s report, `prepare`) writes it
whole into a fresh hidden sibling, `.<name>.partial-<host>-<pid>`, and renames it into place at the end. So an
interrupted or failed command leaves no folder that looks complete: it removes its partial sibling itself, and one
left by a kill is removed by the next command into the same folder. Nothing is written through the old folder, so
a symlink in it is never followed. A finished folder holds MARKER (the command that wrote it and the files it
wrote).

What a command may replace: a new path, an empty folder, or an earlier output of the same command (its marker says
so). Anything else only with `--force`, and then the old folder is moved aside to `<name>.prev-<time>`, never
deleted. An earlier output is deleted only file by file from its marker's list; when the user added files to it,
the old folder is moved aside instead. The folder itself may not be a symlink, and may not lie inside a run folder
or a prepared data folder: moe-lm moves or replaces those whole, and a data folder refuses files it did not make.

A run folder (`train.out_dir`) is written in place while training; it is a folder `moe-lm train` created (MARKER)
or a new or empty one (moe_lm/train/run_folder.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from moe_lm.errors import UserError

MARKER = ".moe-lm.json"
PARTIAL = ".partial-"  # in the staging folder's name: .<name>.partial-<host>-<pid>
FOLDER_KINDS = {"train": "run folder", "prepare": "prepared data folder"}  # written in place or replaced whole


def made_by(folder: Path) -> str | None:
    """The moe-lm command that made `folder` (its marker), or None for a folder moe-lm did not make. Run and data
    folders from before the marker are recognised by what only they hold."""
    try:
        return json.loads((folder / MARKER).read_text())["command"]
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError):
        return None  # an unreadable marker proves nothing
    if (folder / "metrics.jsonl").is_file() or (folder / "checkpoints" / "latest").is_file():
        return "train"
    if (folder / "meta.json").is_file() and (folder / "train").is_dir() and (folder / "val").is_dir():
        return "prepare"
    return None


def write_marker(folder: Path, command: str, files: list[str] | None = None) -> None:
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


def disk_full(error: BaseException | None) -> bool:
    """Whether `error` (or an error it was raised from) is a write that ran out of space. torch's zip writer
    reports ENOSPC as a RuntimeError ("file write failed"), so the chain and the wording are both looked at."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(error, RuntimeError) and ("file write failed" in str(error) or "No space left" in str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


def size_of(folder: Path) -> int:
    """Bytes of the files under `folder` (symlinks not followed)."""
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def some(names: list[str], n: int = 5) -> str:
    """The first `n` of `names` for an error message, with "..." when there are more."""
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


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
            host, _, pid = other.name.rpartition(PARTIAL)[2].rpartition("-")
            if host != socket.gethostname() or _alive(int(pid)):
                raise self._refuse(
                    f"is being written by another moe-lm process (pid {pid} on {host}: {other}); wait for it, or stop "
                    "it and run again (remove that folder by hand if its process is gone)"
                )

    def _partials(self) -> list[Path]:
        """Other processes' staging folders of this path (ours by name and marker)."""
        parent, prefix = self.path.parent, f".{self.path.name}{PARTIAL}"
        if not parent.is_dir():
            return []
        return sorted(p for p in parent.iterdir() if p.name.startswith(prefix) and (p / MARKER).is_file())

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
        for stale in self._partials():  # left by a killed process of this host (check() refused live ones)
            shutil.rmtree(stale, ignore_errors=True)
        stage = self.stage = self.path.parent / f".{self.path.name}{PARTIAL}{socket.gethostname()}-{os.getpid()}"
        try:
            stage.mkdir()
            write_marker(stage, self.command)
        except OSError as e:
            shutil.rmtree(stage, ignore_errors=True)
            _remove_empty(made)
            raise self._refuse(f"cannot write beside it in {self.path.parent} ({e.strerror}); give a writable "
                               "place") from None  # fmt: skip
        free = shutil.disk_usage(stage).free
        if needed_bytes and needed_bytes > free:
            shutil.rmtree(stage, ignore_errors=True)
            _remove_empty(made)
            raise self._refuse(f"needs about {gib(needed_bytes)} and {gib(free)} is free there; free space or give "
                               "another disk (nothing was written)")  # fmt: skip
        try:
            yield stage / self.path.name if self.file else stage
            if self.file:
                self._put_file_in_place(stage)
                return
            files = sorted(str(p.relative_to(stage)) for p in stage.rglob("*") if p.name != MARKER and
                           (p.is_file() or p.is_symlink()))  # fmt: skip
            write_marker(stage, self.command, files)
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
        if made_by(old) == self.command and _remove_listed(old):
            return
        self.say(f"moved the folder that was at {path} to {old} (nothing was deleted)")

    def final(self, written: Path) -> Path:
        """Where a path written inside the staging folder is once the folder is in place (for messages)."""
        return self.path / Path(written).relative_to(self.stage)


def _remove_listed(old: Path) -> bool:
    """Delete an earlier output whose every file its marker lists (True); one holding a file it does not list (the
    user's) is kept whole (False)."""
    try:
        listed = json.loads((old / MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        listed = None
    if not isinstance(listed, list):
        return False
    present = {str(p.relative_to(old)) for p in old.rglob("*") if p.is_file() or p.is_symlink()}
    if not present <= {*listed, MARKER}:
        return False
    shutil.rmtree(old)  # every file is ours; rmtree removes symlinks themselves, never what they point to
    return True


def _remove_empty(folders: list[Path]) -> None:
    for folder in reversed(folders):
        with contextlib.suppress(OSError):
            folder.rmdir()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
