"""The edge every launch script shares with its user: output folders checked before any work, and user errors as
one line on stderr with exit code 2 (argparse's code for bad usage), tracebacks only when asked for.

    if __name__ == "__main__":
        run(main)          # `--debug` anywhere on the command line, or MOE_LM_DEBUG=1, shows the traceback
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import moe_lm.experiments.variants  # noqa: F401  (every command knows the research variants' config names)
from moe_lm.errors import ConfigError, DataError, RunError, UserError

USAGE = 2  # exit code of a user error, as argparse uses for bad arguments


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types that carry a message for the user rather than a bug report."""
    # why FileNotFoundError/ValueError/KeyError: the project's loaders raise them with messages naming the file
    return (UserError, ConfigError, DataError, RunError, FileNotFoundError, ValueError, KeyError)


def debugging() -> bool:
    return "--debug" in sys.argv or os.environ.get("MOE_LM_DEBUG", "") not in ("", "0")


def run(main: Callable[[], None]) -> None:
    """Call a script's `main`; a user error ends it with `error: ...` on stderr and exit code 2."""
    if "--debug" in sys.argv:
        sys.argv.remove("--debug")
        os.environ["MOE_LM_DEBUG"] = "1"
    try:
        main()
    except user_errors() as e:
        if debugging():
            raise
        message = e.args[0] if isinstance(e, KeyError) and e.args else e  # why: KeyError's str() adds quotes
        print(f"error: {message} (--debug shows the traceback)", file=sys.stderr)
        sys.exit(USAGE)


def fail(message: str) -> None:
    """End the script on a user error: `error: message` on stderr, exit code 2 (with --debug: raised, so that the
    traceback shows what was being handled)."""
    if debugging():
        raise UserError(message)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USAGE)


def output_dir(path: str | Path, flag: str = "--out") -> Path:
    """`path` created (with its parents) and checked writable, before anything slow runs."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write_check"):
            pass
    except FileExistsError:
        raise UserError(f"{flag} {out}: exists and is not a folder; give a folder path") from None
    except OSError as e:
        raise UserError(f"{flag} {out}: cannot write there ({e.strerror}); give a writable folder") from None
    return out
