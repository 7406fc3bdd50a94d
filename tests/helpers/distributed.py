"""Running test scripts under the real `deepspeed` launcher (CPU processes, gloo), from both sides.

launch("tests/workers/dist_balance.py", "--out", path, n=2)      # in a pytest test: start N ranks, check exit 0
args = worker_args(ap)                                          # in the script: parse, join the process group
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moe_lm.parallel.deepspeed_setup import init_distributed, remove_shm_buffers, shutdown_distributed

ROOT = Path(__file__).resolve().parents[2]
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, *args: str, n: int = 2, nodes: int = 1, timeout: int = 420) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus n script args` from the repository root; asserts it exits 0.

    With nodes > 1, a multi-node job on this one machine, as a cluster without ssh starts it: one launcher per
    node, each `deepspeed --hostfile H --no_ssh --node_rank i --master_addr 127.0.0.1 --master_port P`, over a
    hostfile of `nodes` loopback hosts with n slots each (world = nodes x n).
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the scripts import tests.* helpers
    for attempt in range(2):
        port = str(free_port())
        logs = Path(tempfile.mkdtemp(prefix="moe_lm_launch_"))
        procs: list[subprocess.Popen] = []
        try:
            procs = _start_nodes(script, args, n, nodes, port, env, logs)
            _wait_all(procs, timeout)
        finally:
            for p in procs:  # a node left running (the other failed, or time ran out): stop it and its ranks
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            remove_shm_buffers(port)  # also when the job crashed before its own clean-up
        outs = [((logs / f"{i}.out").read_text(), (logs / f"{i}.err").read_text()) for i in range(len(procs))]
        shutil.rmtree(logs)
        text = "".join(o + e for o, e in outs)
        # why one retry: the free port can be taken between our probe and the launcher's bind. Nothing else
        # (a failed check, any other error) is retried.
        if "address already in use" not in text.lower() or attempt == 1:
            break
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    assert not failed, f"node(s) {failed} failed:\n" + "\n".join(o[-3000:] + e[-3000:] for o, e in outs)
    return subprocess.CompletedProcess(procs[0].args, 0, outs[0][0], outs[0][1])


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    """Until every launcher exits, one fails (its peers would only wait for it), or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if any(p.returncode for p in procs) or time.monotonic() > deadline:
            return
        time.sleep(0.2)


def _start_nodes(script: str, args, n: int, nodes: int, port: str, env: dict, logs: Path) -> list[subprocess.Popen]:
    cmd = [DEEPSPEED, "--num_gpus", str(n), "--master_port", port]
    if nodes == 1:
        launchers = [cmd]
    else:
        hostfile = logs / "hostfile"
        hostfile.write_text("".join(f"127.0.0.{i + 1} slots={n}\n" for i in range(nodes)))
        multi = ["--hostfile", str(hostfile), "--no_ssh", "--master_addr", "127.0.0.1"]
        launchers = [[*cmd, *multi, "--node_rank", str(i)] for i in range(nodes)]
    procs = []
    for i, c in enumerate(launchers):
        with open(logs / f"{i}.out", "w") as out, open(logs / f"{i}.err", "w") as err:
            # why a session of its own: on a failure or time-out the launcher and all its ranks are stopped together
            procs.append(
                subprocess.Popen([*c, script, *args], cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
            )
    return procs


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
