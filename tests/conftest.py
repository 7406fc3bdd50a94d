"""Shared fixtures, and the tier each one puts a test in.

A test's tier follows from the fixtures it uses (marked here at collection, never by hand):

    launcher      -> launch       DeepSpeed's real launcher (2 + N fresh interpreters): serial
    ranks         -> ranks        several ranks forked over gloo (tests/helpers/ranks.py): serial
    train, trained_run, cli, process
                  -> integration  trains a model or runs a command (in this process or another)

launch and ranks tests are integration tests too. Everything else is a unit test (`make test-fast`). The running
machinery is reached through these fixtures only (tests/test_layout.py holds the test files to it), so the marks
stay true.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import shutil
import signal
import tempfile
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_lm.config import Config, DataConfig
from moe_lm.data.prepare import prepare_data
from tests.helpers import commands, distributed
from tests.helpers.ranks import run_ranks
from tests.helpers.runs import VOCAB, tiny_train_cfg, write_folder_corpus

TIERS = {
    "launcher": ("launch", "integration"),
    "ranks": ("ranks", "integration"),
    "train": ("integration",),
    "trained_run": ("integration",),
    "cli": ("integration",),
    "process": ("integration",),
}


# The files that take longest (tests/README.md, "Time"), first: pytest-xdist hands out whole files in collection
# order (once its own reordering is off, pytest_configure below), and a long file collected near the end (the quick
# tour, the GPU check's dry run, tests/train/'s) kept one worker busy after the others had finished. It starts by
# giving each worker one file in turn (and a second to a worker whose first has two tests or fewer), so the launch
# half's four longest are ordered for two workers: expert parallel + dead peer, pipeline + faults
LONGEST_FIRST = ("test_quick_tour.py", "test_gpu_check.py", "experiments/test_runner.py",
                 "inference/test_speculative.py", "parallel/test_expert_parallel.py", "parallel/test_pipeline.py",
                 "train/test_dead_peer.py", "train/test_faults.py", "train/test_train.py",
                 "interop/test_llama_cpp.py", "interop/test_evaluate.py", "pruning/test_prune_sources.py",
                 "analysis/test_streamed_faults.py", "analysis/test_streamed.py", "analysis/test_engine_routes.py",
                 "cli/test_output_folders.py", "cli/test_console.py", "train/test_pretrained.py",
                 "train/test_recompute.py", "planning/test_comm_plan.py", "bench/test_benchmarks.py",
                 "pruning/test_check.py", "pruning/test_formats.py")  # fmt: skip


def pytest_collection_modifyitems(items):
    for item in items:
        for fixture, marks in TIERS.items():
            if fixture in getattr(item, "fixturenames", ()):
                for mark in marks:
                    item.add_marker(mark)
    here = Path(__file__).parent

    def rank(item) -> int:
        path = Path(item.path).relative_to(here).as_posix() if Path(item.path).is_relative_to(here) else ""
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: every file's tests, and the other files, keep their order


CACHE_VARIABLES = ("HF_HOME", "HF_DATASETS_CACHE", "WANDB_CACHE_DIR")


def pytest_configure(config):
    # why here, before collection: the user caches libraries write into (HF datasets' locks and caches, wandb's
    # service logs) go to a folder of this process's, for the tests and the processes they start, so that a test
    # never writes into the user's ~/.cache; `datasets` reads its variables when it is imported. Torch's extension
    # builds stay shared: moe-lm's own folder, built once under its flock (tests/ops plant their faults elsewhere).
    caches = Path(tempfile.mkdtemp(prefix="moe_lm_test_caches_"))
    config._moe_lm_caches = caches
    os.environ.update({name: str(caches / name.lower()) for name in CACHE_VARIABLES})
    # why one thread per worker under pytest-xdist: two workers on two cores each running torch's default pool
    # (one thread per core) oversubscribe the machine, and OpenMP's spinning threads then slow both down; the
    # processes a test starts (a command, a training subprocess) get the same share through OMP_NUM_THREADS, which
    # torch reads when it starts: a quick-tour `moe-lm train` took 4x longer with its own two threads beside a worker
    # why: a suite started in the background (`nohup make test &`, a CI runner's shell) inherits SIGINT ignored, and
    # so would every process it starts; the Ctrl-C tests need it delivered, as a user's terminal delivers it
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # why: pytest-xdist >= 3.7 deals files with the most tests first (--loadscope-reorder, on by default), which put
    # LONGEST_FIRST's one-test files (the quick tour, 80 s) last: one worker ran on for 75 s after the others ended
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _quiet():
    """A test that trains with logging.verbose (which marks the process verbose) leaves the next one quiet.
    why not monkeypatch.delenv: with the variable unset it records nothing to undo, so a test that turned verbose
    on would leave it set for every later one."""
    os.environ.pop("MOE_LM_VERBOSE", None)
    yield
    os.environ.pop("MOE_LM_VERBOSE", None)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_data")
    corpus = write_folder_corpus(root / "corpus", n_docs=12)
    cfg = DataConfig(sources=[str(corpus)], out_dir=str(root / "prepared"), val_fraction=0.2)
    prepare_data(cfg, vocab_size=VOCAB, log=lambda s: None)
    return cfg


# ---- the running machinery: each fixture marks its tests (TIERS) ----------------------------------------------


@pytest.fixture(scope="session")
def train():
    """Train in this process: `train(cfg)` is moe_lm.train.loop.train."""
    from moe_lm.train import loop

    return loop.train


@pytest.fixture(scope="session")
def trained_run(tiny_data, tmp_path_factory):
    """`trained_run(**settings)`: the folder of a run of tiny_train_cfg(tiny_data, ..., **settings), trained once per
    settings for the whole session and shared. Read it; to damage or continue it, work on `copy_run(...)` of it.
    At the end of the session every shared run must be as it was trained (a test that wrote into one fails here)."""
    from moe_lm.train import loop

    runs: dict[tuple, tuple[Path, list]] = {}

    def get(**settings) -> Path:
        key = tuple(sorted(settings.items()))
        if key not in runs:
            folder = tmp_path_factory.mktemp("trained") / "run"
            # why quiet and with the random state put back: the test that happens to train a shared run first
            # must see the same output and random numbers as one that finds it trained
            with torch.random.fork_rng(), _python_rng_kept(), redirect_stdout(io.StringIO()):
                loop.train(tiny_train_cfg(tiny_data, folder, **settings))
            runs[key] = folder, _listing(folder)
        return runs[key][0]

    yield get
    changed = [str(folder) for folder, listing in runs.values() if _listing(folder) != listing]
    assert not changed, f"a test changed the shared trained runs {changed}: copy_run(...) them first"


@pytest.fixture
def copied_run(trained_run, tiny_data, tmp_path):
    """`copied_run(**settings)`: a copy of `trained_run(**settings)` at tmp_path / "run" (as a user copies a run
    folder), to damage or to continue; returns its config (tiny_train_cfg with those settings)."""

    def copy(**settings) -> Config:
        shutil.copytree(trained_run(**settings), tmp_path / "run", symlinks=True)
        return tiny_train_cfg(tiny_data, tmp_path / "run", **settings)

    return copy


@contextlib.contextmanager
def _python_rng_kept():
    state = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])


def _listing(folder: Path) -> list:
    return sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*"))


@pytest.fixture(scope="session")
def cli():
    """Run a command in this process: `cli("export", "--run", run, ...)` is `moe-lm export ...`,
    `cli.script("export_hf.py", ...)` is `python launch/export_hf.py ...`; each returns the exit code, stdout and
    stderr as a CompletedProcess."""
    return commands.InProcess()


@pytest.fixture(scope="session")
def process():
    """Run a command in a process of its own (tests/helpers/commands.py): `process.moe_lm(...)`,
    `process.script(...)`, `process.train(cfg_file, ...)` and `process.start(...)` (started, not waited for),
    `process.run(cmd, ...)`, `process.pythons_together(code, envs)`, `process.moe_lm_into_closed_pipe(...)`."""
    return commands


@pytest.fixture(scope="session")
def launcher():
    """DeepSpeed's real launcher (tests/helpers/distributed.py): `launcher.launch(script, *args, n=2, nodes=1)`."""
    return distributed


@pytest.fixture(scope="session")
def ranks():
    """`ranks(fn, world, *args, nodes=1)`: fn(*args) on `world` ranks forked over gloo (tests/helpers/ranks.py)."""
    return run_ranks


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "_moe_lm_caches", ""), ignore_errors=True)
