"""A rank that dies mid-run: one survivor names it in one line (rank, last step, newest checkpoint, the command to
resume), with no traceback; the run then resumes from that checkpoint on another number of ranks."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import socket
import time

import psutil
import pytest

from moe_lm.checkpoint.format import ckpt_root, latest_tag
from moe_lm.config import dump_config
from moe_lm.parallel.deepspeed_setup import Peer, init_distributed
from moe_lm.train.stop import PeerLost, WatchPeers
from tests.helpers.runs import rows, tiny_train_cfg

GLOO_CLOSED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [{addr}]:41234. This is "
    "typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error."
)
LINE = re.compile(
    r"^error: rank 1 \(pid (?P<pid>\d+) on (?P<host>\S+)\) died \((?P<why>[^)]*)\); "
    r"last step completed: (?P<done>\d+); newest complete checkpoint: (?P<folder>\S+) \(step (?P<step>\d+)\); "
    r"to resume from it, run the same command: (?P<cmd>.+)$",
    re.M,
)


def a_dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def past_a_checkpoint(run) -> bool:
    """A complete checkpoint exists, and a step is logged after every checkpoint begun (so one that completes
    later, while the test kills a rank, still has a logged step after it)."""
    begun = [int(p.name[5:]) for p in ckpt_root(run).glob("step_*") if p.name[5:].isdigit()]
    try:
        return bool(latest_tag(run)) and rows(run)[-1]["step"] > max(begun)
    except (OSError, IndexError, ValueError):  # no log yet, or its last line half-written
        return False


def test_a_dead_rank_on_this_host_is_named_with_its_pid_step_and_checkpoint(tmp_path):
    init_distributed()  # a world of one; the roster below pretends to a second rank
    host = socket.gethostname()
    dead = a_dead_pid()
    everyone = [Peer(0, host, os.getpid(), ()), Peer(1, host, dead, ())]
    (ckpt_root(tmp_path) / "step_00000004").mkdir(parents=True)
    (ckpt_root(tmp_path) / "step_00000004" / "COMPLETE").write_text("{}")
    with pytest.raises(PeerLost) as lost, WatchPeers(everyone, tmp_path, done=2) as watch:
        watch.done = 5
        raise RuntimeError(GLOO_CLOSED.format(addr="127.0.0.1"))
    assert str(lost.value) == (
        f"rank 1 (pid {dead} on {host}) died (Connection closed by peer [127.0.0.1]:41234); last step completed: 5; "
        f"newest complete checkpoint: {ckpt_root(tmp_path) / 'step_00000004'} (step 4)"
    )
    assert lost.value.report and lost.value.checkpoint == "step_00000004"


def test_a_dead_node_is_named_by_the_address_in_the_backends_error(tmp_path):
    init_distributed()
    me = Peer(0, socket.gethostname(), os.getpid(), ())
    everyone = [me, *(Peer(r, "node2", 1000 + r, ("10.0.0.2",)) for r in (1, 2, 3))]
    with pytest.raises(PeerLost, match=r"^host node2 \(ranks 1-3\) died or became unreachable \(Connection closed"):
        with WatchPeers(everyone, tmp_path):
            raise RuntimeError(GLOO_CLOSED.format(addr="10.0.0.2"))


def test_other_errors_pass_through_unchanged(tmp_path):
    init_distributed()
    everyone = [Peer(0, socket.gethostname(), os.getpid(), ()), Peer(1, "node2", 1, ())]
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes"), WatchPeers(everyone, tmp_path):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")


@pytest.mark.parametrize("ep_size", [2, 1])
def test_kill_9_of_rank_1_is_named_in_one_line_and_the_run_resumes_on_one_process(
    tiny_data, tmp_path, launcher, cli, ep_size
):
    """ep_size 2 -> 1 process at ep_size 1: another world and another ep_size. ep_size 1 -> 1 process: another
    world at the same ep_size (ZeRO's optimizer state does not re-shard: the weights must still load)."""
    run = tmp_path / "run"
    cfg = tiny_train_cfg(tiny_data, run, max_steps=400, ckpt_interval=2, eval_interval=1000, grad_accum_steps=1)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep_size=ep_size))
    dump_config(cfg, tmp_path / "cfg.yaml")
    cmd = launcher.deepspeed(2, launcher.free_port(), "launch/train.py", "--config", f"{tmp_path}/cfg.yaml")
    proc = launcher.start(cmd)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            # why frozen while looking: a tiny step takes tens of ms, so a run left going could save another
            # checkpoint between the look and the kill, leaving no logged step after the checkpoint it resumes from
            os.killpg(proc.pid, signal.SIGSTOP)
            if past_a_checkpoint(run):
                break
            os.killpg(proc.pid, signal.SIGCONT)
            time.sleep(0.2)
        rank1 = [p for p in psutil.Process(proc.pid).children(recursive=True) if "--local_rank=1" in p.cmdline()]
        os.kill(rank1[0].pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "Traceback" not in out, out[-4000:]
    assert len(LINE.findall(out)) == 1, out[-4000:]  # one line, from one rank
    line = LINE.search(out)
    tag = latest_tag(run)
    logged = rows(run)
    assert int(line["pid"]) == rank1[0].pid and "Connection" in line["why"]
    assert line["folder"] == str(ckpt_root(run) / tag) and int(line["step"]) == int(tag[5:])
    assert logged[-1]["step"] <= int(line["done"]) <= logged[-1]["step"] + 1  # the step it was in may have finished
    assert line["cmd"] == shlex.join(["deepspeed", *cmd[1:]])
    # resume on one process; the same global batch (grad_accum x2), so step tag+1 sees the same samples
    resumed_at = int(tag[5:])
    before = {r["step"]: r["loss"] for r in logged}
    proc = cli("train", "--config", tmp_path / "cfg.yaml", "parallel.ep_size=1", "train.grad_accum_steps=2",
               f"train.max_steps={resumed_at + 2}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {ckpt_root(run) / tag} at step {resumed_at}" in proc.stdout
    after = {r["step"]: r["loss"] for r in rows(run)}
    assert sorted(after) == list(range(1, resumed_at + 3))
    # the loss of step tag+1 is computed before its update: the loaded weights on the same batch
    assert after[resumed_at + 1] == pytest.approx(before[resumed_at + 1], abs=1e-4)
