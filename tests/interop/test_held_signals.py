"""Signals while C code calls back into Python (moe_lm/interop/held_signals.py): noted inside the block, raised
after it to the handler that was there before, never dropped (ctypes drops an exception raised in a callback)."""

from __future__ import annotations

import ctypes
import os
import signal
import threading

import pytest

from moe_lm.interop.held_signals import held_signals

pytestmark = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                reason="Python handles signals in the main thread only")  # fmt: skip

COMPARE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))


def sort_in_c(on_first_call) -> int:
    """libc's qsort of 200 ints with a Python comparison: C calling back into Python, as llama.cpp's log and
    evaluation callbacks do; `on_first_call` runs inside the first callback. Returns how many calls were made."""
    calls = [0]

    def compare(a, b):
        calls[0] += 1
        if calls[0] == 1:
            on_first_call()
        return a[0] - b[0]

    values = (ctypes.c_int * 200)(*range(200, 0, -1))
    ctypes.CDLL(None).qsort(values, 200, ctypes.sizeof(ctypes.c_int), COMPARE(compare))
    return calls[0]


def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped KeyboardInterrupt
def test_without_holding_a_ctrl_c_inside_a_callback_is_lost():
    """The failure being guarded against, shown: the KeyboardInterrupt is raised inside the callback, ctypes drops it,
    and the C call runs to its end."""
    assert sort_in_c(ctrl_c) > 200  # every comparison made: nothing stopped it, nothing raised after


def test_a_ctrl_c_inside_a_callback_is_raised_when_the_c_call_returns():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with held_signals() as received:
            done.append(sort_in_c(ctrl_c))
            assert received == [signal.SIGINT]
    assert done and done[0] > 200 and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_goes_to_the_handler_that_was_there_before():
    """SIGTERM to a command raises its Terminated (moe_lm.cli): after the block, that handler gets it."""
    got = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with held_signals():
            sort_in_c(lambda: os.kill(os.getpid(), signal.SIGTERM))
            assert got == []
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_an_ignored_signal_stays_ignored():
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with held_signals():
            os.kill(os.getpid(), signal.SIGHUP)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
