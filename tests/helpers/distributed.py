"""Running test scripts under the real `deepspeed` launcher (CPU processes, gloo), from both sides.

launch("tests/workers/dist_balance.py", "--out", path, n=2)      # in a pytest test: start N ranks, check exit 0
args = worker_args(ap)                                          # in the script: parse, join the process group
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

from moe_lm.parallel.deepspeed_setup import init_distributed, remove_shm_buffers, shutdown_distributed

ROOT = Path(__file__).resolve().parents[2]
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, *args: str, n: int = 2, timeout: int = 420) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus n script args` from the repository root; asserts it exits 0."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the scripts import tests.* helpers
    for attempt in range(2):
        port = str(free_port())
        cmd = [DEEPSPEED, "--num_gpus", str(n), "--master_port", port, script, *args]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        finally:
            remove_shm_buffers(port)  # also when the job crashed before its own clean-up
        # why one retry: the free port can be taken between our probe and the launcher's bind. Nothing else
        # (a failed check, any other error) is retried.
        if "address already in use" not in (proc.stdout + proc.stderr).lower() or attempt == 1:
            break
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def run_worker(main, ap: argparse.ArgumentParser) -> None:
    """The preamble of every script `launch` starts: parse its flags (plus the launcher's --local_rank), join the
    process group, run `main(args)`, leave the group cleanly."""
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None)
    args = ap.parse_args()
    init_distributed()
    main(args)
    shutdown_distributed()
    # why: the checks are done and their result is written; the interpreter's teardown can still abort in a C++
    # thread destructor of the CPU process group ("terminate called without an active exception", seen once in
    # about ten suite runs), which would fail a passing check. Exit without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
