"""Train a DeepSeek-V3-style MoE language model under DeepSpeed.

    moe-lm train                                            # the tiny preset on the embedded corpus -> runs/tiny
    moe-lm train --config gpu_1b --out runs/gpu_1b optim.lr=1e-3
    moe-lm train --nproc 2 parallel.ep_size=2               # 2 processes (GPUs, or CPU processes with gloo)
    deepspeed launch/train.py --config tiny                 # the same under DeepSpeed's launcher, by hand

Re-running with the same run folder resumes from its latest complete checkpoint; train.resume=false starts afresh
(moving the old run folder aside). With --nproc N > 1 the ranks start under DeepSpeed's launcher (quiet); several
nodes: docs/parallelism.md. When a rank dies, one surviving rank prints which, the last step, the newest checkpoint
and the command to resume.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from moe_lm.cli import debugging, main_of
from moe_lm.cli.options import add_config, load
from moe_lm.console import verbose
from moe_lm.errors import UserError
from moe_lm.parallel.ports import free_port

if TYPE_CHECKING:
    from moe_lm.train.stop import PeerLost

COMMAND = "MOE_LM_COMMAND"  # the command line the user typed, for the resume hint of a rank started by a launcher


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_config(ap, out="train.out_dir")
    ap.add_argument(
        "--nproc", type=int, default=1, help="processes on this machine, one per GPU (> 1: under DeepSpeed's launcher)"
    )
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # the launcher's


def run(args: argparse.Namespace) -> None:
    cfg = load(args)
    if args.nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {args.nproc}")
    if args.nproc > 1:
        launch(args)
    from moe_lm.parallel.deepspeed_setup import remove_shm_buffers, shutdown_distributed
    from moe_lm.train.loop import train
    from moe_lm.train.stop import PeerLost, Stopped

    final = None
    try:
        final = train(cfg)
    except PeerLost as e:
        report_dead_peer(e)
    except Stopped as e:
        print(e, file=sys.stderr)
        sys.exit(e.exit_code)
    finally:
        # why on every path: DeepSpeed's CPU all-reduce buffers in /dev/shm outlive the process (docs/deepspeed.md
        # §6); unlinking a file other ranks still map is safe
        remove_shm_buffers(os.environ.get("MASTER_PORT", ""))
        if final is None and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            # why: a failed run of one process leaves no process group behind in a process that goes on (a
            # notebook, a sweep, the in-process command); with several ranks the process ends, and a barrier
            # with ranks that failed elsewhere could hang
            shutdown_distributed()
    shutdown_distributed()
    if int(os.environ.get("RANK", 0)) != 0 or not final:
        return
    h = final["unigram_entropy"]  # of the split the run read (the folder may have been prepared again since)
    per_domain = ", ".join(f"{k[5:]} {v:.3f}" for k, v in final.items() if k.startswith("loss/"))
    print(f"final validation loss {final['loss']:.3f} nats (per domain: {per_domain})")
    print(f"unigram entropy of the training corpus {h:.3f} nats; run folder {cfg.train.out_dir}")


def launch(args: argparse.Namespace) -> NoReturn:
    """Start --nproc ranks of this command under DeepSpeed's launcher, quiet unless verbose, wait for them and exit
    with their code. The ranks inherit --verbose and --debug through the environment.

    Signals: Ctrl-C and SIGTERM (`kill`, `timeout`, a scheduler) sent to this process reach every rank, which
    finishes its step, saves a checkpoint and stops (a second one stops the ranks at once, a third kills them);
    the command then exits 128 + the signal. why not exec the launcher, or share our process group with it:
    DeepSpeed's runner passes no signal on (a `kill` of it leaves the ranks training), and its per-node launcher
    answers one by terminating every process below each rank (wandb's service with it, which ends rank 0 before it
    saves) and killing the ranks 30 s later. So the launcher runs in a process group of its own, out of reach of
    the terminal's Ctrl-C, and this process hands each signal to the ranks themselves."""
    import signal
    import subprocess

    import psutil  # a DeepSpeed dependency
    import torch

    beside = Path(sys.executable).with_name("deepspeed")  # why: this interpreter's, also when not on PATH
    launcher = str(beside) if beside.is_file() else "deepspeed"
    cmd = [launcher, "--num_gpus", str(args.nproc), "--master_port", str(free_port())]
    if not verbose():
        cmd.append("--quiet")
    cmd += ["--module", "moe_lm.cli.train", "--config", args.config, *(["--out", args.out] if args.out else [])]
    typed = ["moe-lm", *sys.argv[1:]] if os.path.basename(sys.argv[0]) == "moe-lm" else ["python", *sys.argv]
    env = {**os.environ, COMMAND: shlex.join(typed)}
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")  # why: else each process announces that it found no GPU
    proc = subprocess.Popen([*cmd, *args.overrides], env=env, process_group=0)
    received: list[int] = []

    def hand_on(signum, frame) -> None:
        received.append(signum)
        ranks = rank_processes(proc.pid)
        if len(received) >= 3 or not ranks:  # the third signal, or no rank started yet: the launcher's whole group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL if len(received) >= 3 else signal.SIGTERM)
            return
        for rank in ranks:
            with contextlib.suppress(psutil.Error):
                rank.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, hand_on)
    code = proc.wait()
    sys.exit(0 if code == 0 else 128 + received[0] if received else code)


def rank_processes(launcher_pid: int) -> list:
    """The rank processes below DeepSpeed's runner `launcher_pid`: the children of its per-node launcher
    (`deepspeed.launcher.launch`), as psutil processes ([] when none has started)."""
    import psutil  # a DeepSpeed dependency

    try:
        below = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.Error:
        return []
    ranks = []
    for process in below:
        try:
            if any("deepspeed.launcher.launch" in part for part in process.parent().cmdline()):
                ranks.append(process)
        except (psutil.Error, AttributeError):
            continue
    return ranks


def report_dead_peer(e: PeerLost) -> NoReturn:
    """Another rank died (`PeerLost`): one line from one rank, then exit at once."""
    from moe_lm.parallel.deepspeed_setup import remove_shm_buffers

    if debugging():
        traceback.print_exception(e)
    if e.report:
        cmd = resume_command()
        if e.checkpoint:
            then = f"to resume from it, run the same command: {cmd}"
        else:  # a run folder with a log and no checkpoint is refused on resume (checkpoint/save_resume.py)
            then = f"there is nothing to resume from; start again with: {cmd} train.resume=false"
        print(f"error: {e}; {then}", file=sys.stderr, flush=True)
    remove_shm_buffers(os.environ.get("MASTER_PORT", ""))
    sys.stdout.flush()
    # why os._exit: the process group is broken; leaving it (a barrier), or the interpreter's teardown of gloo's
    # threads and DeepSpeed's exit hooks, would hang or abort with a C++ message under the line just printed
    os._exit(1)


def resume_command() -> str:
    """The command the user started this run with, to run again: `moe-lm train ...` when that started it, the
    `deepspeed ...` line of the launcher above this process when it can be seen (one node), else this process's
    own arguments. A train.resume=... override is left out: the point is to resume."""
    import psutil  # a DeepSpeed dependency

    def keep(argv):
        return [a for a in argv if not a.startswith(("--local_rank", "--local-rank", "train.resume="))]

    if os.environ.get(COMMAND):
        return shlex.join(keep(shlex.split(os.environ[COMMAND])))
    for parent in psutil.Process().parents():
        try:
            argv = parent.cmdline()
        except psutil.Error:
            continue
        for i, arg in enumerate(argv[:3]):
            if os.path.basename(arg) == "deepspeed" or arg == "deepspeed.launcher.runner":
                return shlex.join(["deepspeed", *keep(argv[i + 1 :])])
    ours = keep(sys.argv[1:])
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # e.g. a multi-node launch: the launcher is on another machine
        return f"the same launcher command (running {shlex.join([sys.argv[0], *ours])})"
    return shlex.join(["python", sys.argv[0], *ours])


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    main_of(sys.modules[__name__], prog, argv)


if __name__ == "__main__":
    main(prog="python -m moe_lm.cli.train")
