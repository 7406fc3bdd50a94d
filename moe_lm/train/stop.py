"""Stopping on a signal without losing work: SIGTERM (what schedulers send before a kill) and Ctrl-C (SIGINT).

The first signal is only noted; the loop finishes the step it is in, saves a checkpoint and raises `Stopped`,
whose exit code (128 + signal) tells a scheduler the job did not finish. Ranks agree after every step, so all of
them stop at the same step even when only one was signalled. A second Ctrl-C stops at once, without saving.
The deepspeed launcher forwards SIGTERM/SIGINT to every rank and waits 30 s before it kills them.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

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

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _note(self, signum, frame) -> None:
        self.signum = self.signum or signum
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C interrupts at once

    def requested(self, device) -> int:
        """The signal any rank received (0: none); the same answer on every rank."""
        flag = torch.tensor([self.signum], device=device)  # on the device: NCCL reduces device tensors only
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
