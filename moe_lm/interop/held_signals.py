"""Ctrl-C, SIGTERM and SIGHUP while C code that calls back into Python runs (llama.cpp: its log callback on every
line it logs, the evaluation callback on every graph node): noted, and raised when the C call returns.

why: Python runs a signal's handler at the next bytecode it executes in the main thread. While the main thread is
inside a C call, that is inside the next callback, and an exception raised in a ctypes callback is printed as
"Exception ignored on calling ctypes callback function" and dropped: Ctrl-C during `analyze --quantise` or a GGUF
analysis was lost, and the command ran on to exit 0 and wrote its output. A try in the callback cannot catch it
all: the handler may run as the callback is entered, before any try. So while the C call runs, the handlers only
note the signal; the callback may ask whether one came (to stop llama.cpp's graph early), and on leaving, each
noted signal is raised again to the handler that was there before (KeyboardInterrupt, the command's Terminated,
or the default action).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def held_signals() -> Iterator[list[int]]:
    """Within the block the signals of HELD are noted in the list it yields, not handled; after it, raised again in
    the order they came. Only in the main thread (Python handles signals there); a signal that is ignored stays so."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    finished = False

    def note(signum, frame):
        if not finished:
            received.append(signum)
        else:  # why: a signal that came while the handlers were being put back found this one still in place
            _handle(signum, before[signum], frame)

    before = {sig: signal.signal(sig, note) for sig in HELD if signal.getsignal(sig) not in (signal.SIG_IGN, None)}
    try:
        yield received
    finally:
        finished = True
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(received):
            signal.raise_signal(sig)  # why raise_signal: it runs the restored handler before returning


def _handle(signum: int, handler, frame) -> None:
    """What `handler` (a function, or SIG_DFL) does with the signal."""
    if callable(handler):
        handler(signum, frame)
    else:
        signal.signal(signum, handler)
        signal.raise_signal(signum)
