"""Running the project's commands as a user does: in this process (`InProcess`, the `cli` fixture; most tests) or
in a process of their own (the functions below, the `process` fixture) where the process boundary is the subject:
the console a user sees at file-descriptor level, signals, a fresh interpreter's imports, the entry points' wiring.

In a process of its own, the process-group variables of the calling process are left out: a test process that
trained in-process holds a rendezvous address, which a command's own single-process training would otherwise join.
"""

from __future__ import annotations

import io
import os
import runpy
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MOE_LM = str(Path(sys.executable).with_name("moe-lm"))
_GROUP = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class InProcess:
    """`moe-lm ...` and `python launch/<script> ...` run in this process, seen as a shell sees them: the exit code
    (2 for a user error, 1 and the traceback on stderr for an uncaught exception), stdout and stderr.

    What a fresh process would not keep is put back afterwards: the environment, the working directory, sys.argv.
    Python warnings print to stderr as the interpreter prints them. Output written below Python (a C++ library's
    own prints) is not captured; tests about that console use `process`.
    """

    def __call__(self, *argv, cwd=None) -> subprocess.CompletedProcess:
        from moe_lm.cli.main import main

        args = [str(a) for a in argv]
        return self._run(["moe-lm", *args], lambda: main(args), cwd)

    def script(self, name: str, *argv, cwd=None) -> subprocess.CompletedProcess:
        path = str(ROOT / "launch" / name)
        return self._run([path, *map(str, argv)], lambda: runpy.run_path(path, run_name="__main__"), cwd)

    @staticmethod
    def _run(argv: list[str], entry: Callable[[], object], cwd) -> subprocess.CompletedProcess:
        out, err = io.StringIO(), io.StringIO()
        saved = dict(os.environ), os.getcwd(), sys.argv
        sys.argv, code = list(argv), 0
        try:
            if cwd is not None:
                os.chdir(cwd)
            with redirect_stdout(out), redirect_stderr(err), warnings.catch_warnings():
                _interpreter_warnings()
                try:
                    entry()
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                    if not isinstance(e.code, int | None):
                        print(e.code, file=sys.stderr)
                except Exception:
                    traceback.print_exc()
                    code = 1
        finally:
            os.environ.clear()
            os.environ.update(saved[0])
            os.chdir(saved[1])
            sys.argv = saved[2]
        return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def _interpreter_warnings() -> None:
    """The warning filters and output of a fresh interpreter (pytest's would record them instead of printing)."""
    warnings.resetwarnings()
    warnings.simplefilter("default")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category)
    warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
        warnings.formatwarning(message, category, filename, lineno, line)
    )


# ---- in a process of its own -----------------------------------------------------------------------------------


def clean_env(extra: dict | None = None) -> dict:
    return {**{k: v for k, v in os.environ.items() if k not in _GROUP}, **(extra or {})}


def run(cmd: list, *, env: dict | None = None, cwd=None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Any command, waited for, its output captured as text (the group variables left out unless `env` is given)."""
    cmd = [str(c) for c in cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or clean_env(), cwd=cwd)


def python(code: str, *, env: dict | None = None, cwd=ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -c code` in a fresh interpreter (this one's), from the repository root."""
    return run([sys.executable, "-c", code], env=env, cwd=cwd, timeout=timeout)


def pythons_together(code: str, envs: list[dict], *, timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """`python -c code` in one fresh interpreter per environment, all started before any is waited for (the ranks
    of one host, say); killed at the timeout."""
    started = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for env in envs
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in started]
    finally:
        for p in started:
            p.kill()
    return [
        subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(started, outs, strict=True)
    ]


def script(name: str, *args, env: dict | None = None, cwd=None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python launch/<name> args...`."""
    return run([sys.executable, ROOT / "launch" / name, *args], env=env, cwd=cwd, timeout=timeout)


def moe_lm(*args, env: dict | None = None, cwd=None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`moe-lm args...` (the console script installed beside this interpreter)."""
    return run([MOE_LM, *args], env=env, cwd=cwd, timeout=timeout)


def start(*args, env: dict | None = None, cwd=None) -> subprocess.Popen:
    """`moe-lm args...` started (not waited for), for signals: its output captured as text."""
    cmd = [str(MOE_LM), *map(str, args)]
    return subprocess.Popen(cmd, cwd=cwd, env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def moe_lm_into_closed_pipe(*args, timeout: int = 600) -> subprocess.CompletedProcess:
    """`moe-lm args... | head -0`, deterministically: its stdout a pipe whose reader is gone before it writes."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([str(MOE_LM), *map(str, args)], stdout=write, stderr=subprocess.PIPE, text=True,
                              timeout=timeout, env=clean_env())  # fmt: skip
    finally:
        os.close(write)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", proc.stderr)


def train(cfg_file: Path, *overrides: str) -> subprocess.Popen:
    """`python launch/train.py --config cfg_file overrides...` started (not waited for), for signals and kills."""
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(cfg_file), *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
