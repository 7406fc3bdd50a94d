"""The command line: `moe-lm <command>` (main.py) and the launch/ scripts, one module per command here, each with
`add_arguments(parser)`, `run(args)` and `main(argv)`. What every command shares with its user: flags of one
meaning (options.py), output folders checked before any work and written whole (moe_lm/output_folder.py), and a
user error as one line on stderr with exit code 2 (argparse's code for bad usage); `--debug` (or MOE_LM_DEBUG=1)
shows the traceback. A user error is one of the project's own types (moe_lm/errors.py), which the loaders raise
with their messages; any other exception is a bug and ends with its traceback (exit code 1), so that it is reported.

Importing this package registers the research variants (moe_lm/experiments/variants), so that every command knows
their config names.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import stat
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

import moe_lm.experiments.variants  # noqa: F401
from moe_lm.console import quiet_deepspeed, set_verbose
from moe_lm.errors import ConfigError, DataError, RunError, UserError
from moe_lm.output_folder import OutputFolder

quiet_deepspeed()  # why at the front door: transformers imports deepspeed too, when it is installed

USAGE = 2  # exit code of a user error, as argparse uses for bad arguments
PIPE_CLOSED = 128 + signal.SIGPIPE  # what a shell reports of a tool whose reader went away (`... | head`)


class Terminated(BaseException):
    """SIGTERM (`kill`, `timeout`, a scheduler) or SIGHUP (the terminal closed) to a command: raised where the
    command is, so that a folder being written is removed as on Ctrl-C (a BaseException: no `except Exception`
    swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types that carry a message for the user rather than a bug report: the project's own
    (moe_lm/errors.py). Anything else is a bug, and shows its traceback."""
    return (UserError, ConfigError, DataError, RunError)


def debugging() -> bool:
    return "--debug" in sys.argv or os.environ.get("MOE_LM_DEBUG", "") not in ("", "0")


def run(main: Callable[[], None]) -> None:
    """Call a command's work; a user error ends it with `error: ...` on stderr and exit code 2. Ctrl-C, SIGTERM and
    SIGHUP end it in one line (a folder being written removed), output piped into a reader that went away
    (`| head`) quietly."""
    if "--debug" in sys.argv:
        sys.argv.remove("--debug")
        os.environ["MOE_LM_DEBUG"] = "1"
    received: list[int] = []
    try:
        with _signals_raise(received):
            try:
                main()
            finally:
                sys.stdout.flush()  # why here: a reader that went away (`| head`) is then met in the handlers below
    except SystemExit:
        raise
    except BaseException as e:
        # why the signal first, whatever was raised: a library can turn the exception a signal raised inside it
        # into one of its own (torch's tensor conversion into "ValueError: could not determine the shape"), and
        # the command would end in a traceback, or in an error that is not what happened
        signum = received[0] if received else _signal_of(e)
        if signum is not None and not debugging():
            # why one line: an output folder is written whole or not at all (moe_lm/output_folder.py), so there is
            # nothing to report; training handles its first Ctrl-C or SIGTERM itself (a checkpoint, then 128 + signal)
            print("interrupted (Ctrl-C)" if signum == signal.SIGINT else f"terminated ({signal.Signals(signum).name})",
                  file=sys.stderr)  # fmt: skip
            sys.exit(128 + signum)
        if isinstance(e, BrokenPipeError) and _stdout_is_a_pipe():
            # why stdout onto /dev/null: the interpreter flushes it once more at exit, which would print a second error
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(PIPE_CLOSED)
        if isinstance(e, user_errors()) and not debugging():
            message = e.args[0] if isinstance(e, KeyError) and e.args else e  # why: KeyError's str() adds quotes
            print(f"error: {message} (--debug shows the traceback)", file=sys.stderr)
            sys.exit(USAGE)
        raise


def _signal_of(e: BaseException) -> int | None:
    if isinstance(e, Terminated):
        return e.signum
    return signal.SIGINT if isinstance(e, KeyboardInterrupt) else None


@contextlib.contextmanager
def _signals_raise(received: list[int]):
    """SIGTERM and SIGHUP raise Terminated in the command while it runs, Ctrl-C KeyboardInterrupt as Python's own
    handler does, and each is noted in `received` (the handlers before are put back after: commands also run
    inside other programs, the test suite's workers among them). Only where nothing else handles them already and
    only in the main thread (Python delivers signals there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_for(signum, frame):
        received.append(signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    before = {}
    for sig, unhandled in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGHUP, signal.SIG_DFL),
                           (signal.SIGINT, signal.default_int_handler)):  # fmt: skip
        if signal.getsignal(sig) is unhandled:
            before[sig] = signal.signal(sig, raise_for)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _stdout_is_a_pipe() -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode)
    except (OSError, ValueError, AttributeError):  # no descriptor (a test's captured stdout): not ours to judge
        return False


def fail(message: str) -> None:
    """End the command on a user error: `error: message` on stderr, exit code 2 (with --debug: raised, so that the
    traceback shows what was being handled)."""
    if debugging():
        raise UserError(message)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USAGE)


def output_folder(args: argparse.Namespace, command: str) -> OutputFolder:
    """The --out folder of a command that writes one, checked before anything slow runs: written whole beside it
    and renamed into place, never into what moe-lm did not write (moe_lm/output_folder.py)."""
    return OutputFolder(args.out, command, force=getattr(args, "force", False))


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions kept as written (their usage examples), each flag's default shown after its help unless it is
    None or False (such flags say in their help what stands in for them)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def command_parser(command: ModuleType, ap: argparse.ArgumentParser | None = None, prog: str | None = None):
    """`ap` (or a new parser named `prog`) with a command module's flags, its docstring as the description, and
    --verbose/--debug."""
    if ap is None:
        ap = argparse.ArgumentParser(prog=prog)
    ap.description, ap.formatter_class = command.__doc__, HelpFormatter
    command.add_arguments(ap)
    ap.add_argument("--verbose", action="store_true", help="show DeepSpeed's INFO lines and wandb's banners")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error (also MOE_LM_DEBUG=1)")
    return ap


def start(command: ModuleType, args: argparse.Namespace) -> None:
    """Run a parsed command: --verbose and --debug first, then its `run(args)` under the one-line error rule."""
    if args.debug:
        os.environ["MOE_LM_DEBUG"] = "1"
    set_verbose(args.verbose)
    run(lambda: command.run(args))


def main_of(command: ModuleType, prog: str, argv: Sequence[str] | None = None) -> None:
    """What a launch/ script (and `python -m moe_lm.cli.<command>`) runs: parse argv, then `start`."""
    start(command, command_parser(command, prog=prog).parse_args(argv))
