"""Where and how torch's C++ extension loader builds for moe-lm: our CPU kernels (`cpu_kernels.py`) and, on CPU,
DeepSpeed's shared-memory communication op (built inside `deepspeed.init_distributed`).

Three rules, each for a failure seen here:
- One build folder per source tree (its name carries a hash of the sources' folder): two checkouts or venvs sharing
  a cache would otherwise rebuild over each other at every switch.
- One build at a time, under an flock the kernel releases when a process dies. torch's own lock is a plain `lock`
  file, which a killed build (Ctrl-C or a kill during the first minute) never removes, and torch waits on it
  forever with no message: a later `make setup` hung until CI's time ran out. Under our flock a `lock` torch finds
  in our folder can only be such a leftover, so it is removed first. Folders that are not ours are never touched.
- This environment's ninja first on PATH (`environment_ninja`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
from pathlib import Path


def build_folder(name: str, sources: Path) -> Path:
    """moe-lm's build folder of extension `name` built from the folder `sources`, created: under
    TORCH_EXTENSIONS_DIR or torch's default root, as torch names its own (py<version>_cpu/), with a hash of
    `sources` in its name."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    where = hashlib.sha256(str(sources.resolve()).encode()).hexdigest()[:8]
    folder = root / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / f"{name}_{where}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def one_build_at_a_time(folder: Path):
    """Hold an flock on `folder` (one of ours) while torch builds or loads there; a `lock` torch finds then was left
    by a build that was killed, and is removed."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".moe_lm_build.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        yield


@contextlib.contextmanager
def library_op_builds(package: Path, op: str):
    """While a library installed in `package` (DeepSpeed) builds or loads its op `op` with torch's loader: in
    moe-lm's folder for that installation (TORCH_EXTENSIONS_DIR pointed there, then restored), one build at a time,
    this environment's ninja.

    why our folder: DeepSpeed builds in torch's shared default folder, where a killed build's `lock` hangs every later
    start and where another tool's build may be running (so its `lock` is not ours to remove)."""
    root = build_folder(package.name, package)
    before = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(root)
    try:
        with environment_ninja(), one_build_at_a_time(root / op):
            yield
    finally:
        if before is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = before


@contextlib.contextmanager
def environment_ninja():
    """While torch builds or loads a cached extension: this environment's ninja (installed beside the interpreter,
    a DeepSpeed dependency) first on PATH.

    why: torch runs whichever `ninja` PATH finds first. With a system ninja of another version, the same venv used
    with its bin/ on PATH (activated, `moe-lm`) and without (`.venv/bin/python`) alternates between two ninjas whose
    build logs differ, and each one rebuilds the cached extension from scratch (a minute or more per switch).
    """
    beside = Path(sys.executable).with_name("ninja")
    if not beside.is_file():
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{beside.parent}{os.pathsep}{path}"
    try:
        yield
    finally:
        os.environ["PATH"] = path
