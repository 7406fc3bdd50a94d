"""Running the project's commands as a user does, in a process of their own: a launch/ script or `moe-lm`.

The process-group variables of the calling process are left out: a test process that trained in-process holds a
rendezvous address, which a command's own single-process training would otherwise join.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MOE_LM = str(Path(sys.executable).with_name("moe-lm"))
_GROUP = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env(extra: dict | None = None) -> dict:
    return {**{k: v for k, v in os.environ.items() if k not in _GROUP}, **(extra or {})}


def script(name: str, *args, env: dict | None = None, cwd=None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python launch/<name> args...`."""
    cmd = [sys.executable, str(ROOT / "launch" / name), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or clean_env(), cwd=cwd)


def moe_lm(*args, env: dict | None = None, cwd=None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`moe-lm args...` (the console script installed beside this interpreter)."""
    cmd = [MOE_LM, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or clean_env(), cwd=cwd)


def train_process(cfg_file: Path, *overrides: str) -> subprocess.Popen:
    """`python launch/train.py --config cfg_file overrides...` started (not waited for), for signals and kills."""
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(cfg_file), *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def analyze(*args) -> subprocess.CompletedProcess:
    """`python launch/analyze_routing.py args...`, which must succeed."""
    proc = script("analyze_routing.py", *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
