"""A quiet, honest console: a training run prints moe-lm's own lines only (no DeepSpeed launcher or engine INFO
lines, no accelerator notice, no wandb banner), also with several processes under DeepSpeed's launcher; --verbose
brings the libraries' lines back."""

from __future__ import annotations

import os
import signal
import time

import pytest

from moe_lm.config import dump_config
from tests.helpers.runs import tiny_train_cfg, with_train

# what moe-lm itself prints during a run (tracker, loop, train command)
OURS = (
    "moe-lm: ",
    "[",
    "saved checkpoint",
    "final validation loss",
    "unigram entropy",
    "warning: ",
    "note: ",
    "attention: ",
    "torch.compile: ",
)


@pytest.fixture(scope="module")
def config(tiny_data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("console")
    cfg = tiny_train_cfg(tiny_data, folder / "run", max_steps=2, eval_interval=2, ckpt_interval=2)
    dump_config(with_train(cfg), folder / "cfg.yaml")
    return folder / "cfg.yaml"


def only_ours(proc) -> None:
    """The run ended well and printed moe-lm's own lines only, the final validation loss among them."""
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    foreign = [line for line in lines if not line.startswith(OURS)]
    assert not foreign, foreign
    assert any(line.startswith("final validation loss") for line in lines)


# why processes of their own: the subject is everything that reaches the console at file-descriptor level, also
# what C++ libraries and DeepSpeed's launcher print, which a command run in this process would not show


def test_a_run_prints_only_its_own_lines(process, config, tmp_path):
    only_ours(process.moe_lm("train", "--config", config, "--out", tmp_path / "run", "logging.wandb_mode=offline"))


def test_a_run_of_two_processes_prints_only_its_own_lines(launcher, process, config, tmp_path):
    """`--nproc 2`: the command becomes DeepSpeed's launcher, whose lines and the ranks' are kept quiet too."""
    proc = launcher.run([process.MOE_LM, "train", "--config", config, "--nproc", 2, "--out", tmp_path / "run",
                         "logging.wandb_mode=offline"])  # fmt: skip
    only_ours(proc)


def test_verbose_shows_the_libraries_lines(process, config, tmp_path):
    """One process is enough: --verbose lifts the console's filter in every process alike (the launcher's lines
    are DeepSpeed's logger's, the one the engine's go through)."""
    proc = process.moe_lm("train", "--config", config, "--out", tmp_path / "run", "--verbose")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "[INFO]" in proc.stdout + proc.stderr  # DeepSpeed's engine lines


@pytest.mark.parametrize("argv", [["config", "--list"], ["experiment", "--table", "docs/results"]])
def test_output_into_a_pipe_whose_reader_is_gone_ends_quietly(process, argv):
    """`moe-lm ... | head` printed a BrokenPipeError traceback and exited 1; it now ends as Unix tools do: nothing on
    stderr, 128 + SIGPIPE."""
    proc = process.moe_lm_into_closed_pipe(*argv)
    assert proc.returncode == 141 and proc.stderr == "", (proc.returncode, proc.stderr[-2000:])


@pytest.mark.parametrize(
    "sig, said", [(signal.SIGTERM, "terminated (SIGTERM)"), (signal.SIGINT, "interrupted (Ctrl-C)")]
)
def test_a_signal_a_library_turned_into_its_own_error_ends_the_command_as_that_signal(capsys, sig, said):
    """SIGTERM during `analyze --quantise` under load ended in a traceback, `ValueError: could not determine the
    shape of object type 'torch.storage.UntypedStorage'`: raised inside torch's tensor conversion, the signal's
    exception came out as torch's own. A signal the command received decides how it ends, whatever was raised."""
    import threading

    from moe_lm.cli import run

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("Python handles signals in the main thread only")

    def work():
        try:
            os.kill(os.getpid(), sig)
            time.sleep(10)
        except BaseException:
            raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from None

    with pytest.raises(SystemExit) as ended:
        run(work)
    assert ended.value.code == 128 + sig and capsys.readouterr().err == said + "\n"
