"""How a run stops short: on a signal without losing work, or because another rank died.

Signals: SIGTERM (what schedulers send before a kill) and Ctrl-C (SIGINT).

The first signal is only noted; the loop finishes the step it is in, saves a checkpoint and raises `Stopped`,
whose exit code (128 + signal) tells a scheduler the job did not finish. Ranks agree after every step, so all of
them stop at the same step even when only one was signalled. A second Ctrl-C stops at once, without saving.
The deepspeed launcher forwards SIGTERM/SIGINT to every rank and waits 30 s before it kills them.

A dead peer: `WatchPeers` turns the error a collective raises when another rank dies (killed, out of memory, its
node gone) into `PeerLost`, whose message names the dead rank (or host), the last step completed and the newest
complete checkpoint. Only one rank reports it (rank 0, or the lowest survivor when rank 0 is the dead one), so the
user reads one line instead of a traceback from every rank. why here and not in the launcher: the launcher only
sees an exit code (and prints the command of the last rank it started, whichever died); the survivor knows the
step and the run folder.
"""

from __future__ import annotations

import signal
from pathlib import Path

import torch
import torch.distributed as dist

from moe_lm.checkpoint.format import ckpt_root, latest_tag
from moe_lm.errors import RunError
from moe_lm.parallel.deepspeed_setup import (
    Peer,
    dead_ranks,
    is_peer_failure,
    leaving_on_purpose,
    peer_failure_reason,
    suspect_host,
)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """Training stopped on a signal after saving; `exit_code` is 128 + the signal number."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class StopOnSignal:
    """Context manager: notes the first SIGTERM/SIGINT (`requested()` asks all ranks), restores handlers on exit."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous = {}

    def __enter__(self) -> StopOnSignal:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, PeerLost):
            # why: the launcher SIGTERMs every rank as soon as one dies; the default handler would end this rank
            # before it names the dead one. The process is on its way out: the noting handler stays.
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _note(self, signum, frame) -> None:
        self.signum = self.signum or signum
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C interrupts at once

    def requested(self, device) -> int:
        """The signal any rank received (0: none); the same answer on every rank."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.signum  # why not through a tensor: on a GPU, .item() waits for the step's queued work
        flag = torch.tensor([self.signum], device=device)  # on the device: NCCL reduces device tensors only
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


class PeerLost(RunError):
    """Another rank died: `report` says whether this rank is the one that prints the message."""

    def __init__(self, message: str, report: bool, checkpoint: str | None) -> None:
        super().__init__(message)
        self.report = report
        self.checkpoint = checkpoint  # the newest complete checkpoint's tag, None when there is none


class WatchPeers:
    """Context manager around the training loop: a collective failing because a peer is gone leaves as `PeerLost`.
    The loop sets `done` to the last step it completed."""

    def __init__(self, everyone: list[Peer], run_dir: Path, done: int = 0) -> None:
        self.everyone, self.run_dir, self.done = everyone, run_dir, done

    def __enter__(self) -> WatchPeers:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None or not is_peer_failure(exc) or len(self.everyone) < 2:
            return
        me = dist.get_rank()
        lost, who = self._lost(exc)
        reporter = min({p.rank for p in self.everyone} - set(lost))
        if me != reporter:
            leaving_on_purpose()  # why: so that the reporter does not count this rank among the dead once it exits
        tag = latest_tag(self.run_dir)
        where = f"{ckpt_root(self.run_dir) / tag} (step {int(tag.split('_')[-1])})" if tag else "none"
        message = (
            f"{who} ({peer_failure_reason(exc)}); last step completed: {self.done}; newest complete checkpoint: {where}"
        )
        raise PeerLost(message, report=me == reporter, checkpoint=tag) from exc

    def _lost(self, exc: BaseException) -> tuple[list[int], str]:
        """The ranks known or suspected gone, and the words for them."""
        dead = dead_ranks(self.everyone)
        if dead:
            names = ", ".join(f"{p.rank} (pid {p.pid} on {p.host})" for p in (self.everyone[r] for r in dead))
            return dead, f"rank{'s' if len(dead) > 1 else ''} {names} died"
        host = suspect_host(self.everyone, exc)
        if host:
            on_it = [p.rank for p in self.everyone if p.host == host]
            return on_it, f"host {host} ({_ranks(on_it)}) died or became unreachable"
        return [], "another rank died or the network between ranks failed"


def _ranks(ranks: list[int]) -> str:
    """'rank 3', 'ranks 8-15' (consecutive), 'ranks 1, 3, 5'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))
