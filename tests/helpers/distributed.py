"""DeepSpeed's real launcher, for the tests whose subject it is (the `launcher` fixture): a multi-node job started
without ssh, a dead peer, signals to every rank, the console of a multi-process run, the shared memory left behind,
the documented `deepspeed launch/train.py` command. Multi-rank tests of anything else fork their ranks
(tests/helpers/ranks.py): the launcher starts 2 + N fresh interpreters, which is most of such a test's time.

launch("launch/train.py", "--config", cfg, n=2, nodes=2)     # run to the end; asserts every node exits 0
proc = start(deepspeed(2, port, "launch/train.py", ...))      # started in a session of its own, for signals
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moe_lm.parallel.deepspeed_setup import remove_shm_buffers
from moe_lm.parallel.ports import free_port
from tests.helpers.commands import clean_env

ROOT = Path(__file__).resolve().parents[2]
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
# why one thread per rank: N ranks on a machine of few cores, each with a thread per core, oversubscribe it many
# times over (an 8-rank job ran 4x slower on 2 cores); a user's launcher on a real cluster sets this too
RANK_THREADS = {"OMP_NUM_THREADS": "1"}


def deepspeed(n: int, port: int | str, *args) -> list[str]:
    """`deepspeed --num_gpus n --master_port port args...`."""
    return [DEEPSPEED, "--num_gpus", str(n), "--master_port", str(port), *map(str, args)]


def start(cmd: list, **kwargs) -> subprocess.Popen:
    """`cmd` (a launcher, or a command that starts one) from the repository root without the calling process's
    group variables, stdout and stderr merged, in a session of its own: a test can signal or kill the launcher and
    every rank at once."""
    kwargs = {
        "cwd": ROOT,
        "env": clean_env(RANK_THREADS),
        "stdout": subprocess.PIPE,
        "stderr": subprocess.STDOUT,
        **kwargs,
    }
    return subprocess.Popen([str(c) for c in cmd], text=True, start_new_session=True, **kwargs)


def run(cmd: list, timeout: float = 420, **kwargs) -> subprocess.CompletedProcess:
    """`start(cmd)` waited for; on a time-out the launcher and its ranks are killed. Output in .stdout."""
    proc = start(cmd, **kwargs)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def launch(script: str, *args: str, n: int = 2, nodes: int = 1, timeout: int = 420) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus n script args` from the repository root; asserts it exits 0.

    With nodes > 1, a multi-node job on this one machine, as a cluster without ssh starts it: one launcher per
    node, each `deepspeed --hostfile H --no_ssh --node_rank i --master_addr 127.0.0.1 --master_port P`, over a
    hostfile of `nodes` loopback hosts with n slots each (world = nodes x n).
    """
    env = {**os.environ, **RANK_THREADS}
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
    cmd = deepspeed(n, port)
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
