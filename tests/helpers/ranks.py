"""Several ranks of one job, forked over gloo: for the multi-rank tests whose subject is not DeepSpeed's launcher.

results = run_ranks(check, 4, "zero2")            # check("zero2") on 4 ranks; its return values, rank by rank
results = run_ranks(check, 4, nodes=2)            # two "nodes" of 2 ranks (CROSS_RANK 0 | 1), as two launchers give

why not the launcher: `deepspeed --num_gpus N script` starts 2 + N fresh interpreters, each importing torch and
DeepSpeed (seconds each on a 2-core machine) before any rank computes. Here every rank is forked from one server
process (multiprocessing's forkserver) that imported torch, DeepSpeed and moe-lm and loaded the CPU kernels once
(tests/helpers/rank_preload.py), and it gets the environment the launcher would give it (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT, CROSS_RANK, CROSS_SIZE, LOCAL_SIZE). The server never joins a process group or
starts a thread pool, so what each rank inherits is a clean interpreter. The launcher itself stays under test
where it is the subject (tests/helpers/distributed.py: the 2-node job, a dead peer, signals, the console).

Each rank's stdout and stderr go to a log file of its own; a rank that fails (an exception, an exit, a time-out)
fails the call with its traceback and every rank's log tail.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from tests.helpers.distributed import free_port

PRELOAD = "tests.helpers.rank_preload"
_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload([PRELOAD])
    return _context


def run_ranks(fn: Callable, world: int, *args, nodes: int = 1, env: dict | None = None, timeout: float = 420) -> list:
    """`fn(*args)` on `world` ranks of one process group (`nodes` nodes of world // nodes ranks); the value each
    rank returned, in rank order. `fn` must be importable (a module-level function), as must `args`."""
    assert world % nodes == 0, (world, nodes)
    for attempt in range(2):
        port = free_port()
        folder = Path(tempfile.mkdtemp(prefix="moe_lm_ranks_"))
        try:
            procs = [
                _forkserver().Process(target=_rank, args=(fn, args, rank, world, nodes, port, env or {}, folder))
                for rank in range(world)
            ]
            for p in procs:
                p.start()
            _wait(procs, timeout)
            logs = [_tail(folder / f"{rank}.log") for rank in range(world)]
            failed = [rank for rank, p in enumerate(procs) if p.exitcode != 0]
            # why one retry: the free port can be taken between our probe and rank 0's bind; nothing else is retried
            if failed and attempt == 0 and any("address already in use" in log.lower() for log in logs):
                continue
            if failed:
                why = {rank: ("timed out" if procs[rank].exitcode is None else f"exit {procs[rank].exitcode}")
                       for rank in failed}  # fmt: skip
                raise AssertionError(f"ranks {why} of {fn.__module__}.{fn.__name__} failed:\n" + "\n".join(
                    f"--- rank {rank} ---\n{log}" for rank, log in enumerate(logs)))  # fmt: skip
            return [pickle.loads((folder / f"{rank}.result").read_bytes()) for rank in range(world)]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
            from moe_lm.parallel.deepspeed_setup import remove_shm_buffers

            remove_shm_buffers(str(port))  # also when a rank died before its own clean-up
            shutil.rmtree(folder, ignore_errors=True)
    raise AssertionError("unreachable")


def _wait(procs, timeout: float) -> None:
    """Until every rank exits, or one fails (its peers may wait for it forever: a short grace, then they are
    killed), or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + 10)
        time.sleep(0.05)


def _tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.is_file() else "(no log)"


def _rank(fn, args, rank: int, world: int, nodes: int, port: int, env: dict, folder: Path) -> None:
    """One rank: its log as stdout and stderr, the launcher's environment, the process group, `fn`, its result."""
    log = os.open(folder / f"{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    per_node = world // nodes
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank % per_node), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), CROSS_RANK=str(rank // per_node), CROSS_SIZE=str(nodes), LOCAL_SIZE=str(per_node),
        **env,
    )  # fmt: skip
    import torch

    # why: N ranks on fewer cores, each with a thread per core, would oversubscribe the machine many times over
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
    code = 0
    try:
        from moe_lm.parallel.deepspeed_setup import init_distributed, shutdown_distributed

        init_distributed()
        result = fn(*args)
        (folder / f"{rank}.result").write_bytes(pickle.dumps(result))
        shutdown_distributed()
    except BaseException:
        traceback.print_exc()
        code = 1
    # why os._exit: the result is written; the interpreter's teardown can still abort in a C++ thread destructor of
    # the CPU process group, and a forked child must not run the server's exit handlers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
