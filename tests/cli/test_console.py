"""A quiet, honest console: a training run prints moe-lm's own lines only (no DeepSpeed launcher or engine INFO
lines, no accelerator notice, no wandb banner), also with several processes under DeepSpeed's launcher; --verbose
brings the libraries' lines back."""

from __future__ import annotations

import pytest

from moe_lm.config import dump_config
from tests.helpers.commands import moe_lm
from tests.helpers.runs import tiny_train_cfg, with_train

# what moe-lm itself prints during a run (tracker, loop, train command)
OURS = ("moe-lm: ", "[", "saved checkpoint", "final validation loss", "unigram entropy", "warning: ", "note: ")


@pytest.fixture(scope="module")
def config(tiny_data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("console")
    cfg = tiny_train_cfg(tiny_data, folder / "run", max_steps=2, eval_interval=2, ckpt_interval=2)
    dump_config(with_train(cfg), folder / "cfg.yaml")
    return folder / "cfg.yaml"


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_run_prints_only_its_own_lines(config, tmp_path, nproc):
    proc = moe_lm("train", "--config", config, "--nproc", nproc, "--out", tmp_path / "run",
                  "logging.wandb_mode=offline")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    foreign = [line for line in lines if not line.startswith(OURS)]
    assert not foreign, foreign
    assert any(line.startswith("final validation loss") for line in lines)


@pytest.mark.slow
def test_verbose_shows_the_libraries_lines(config, tmp_path):
    proc = moe_lm("train", "--config", config, "--nproc", "2", "--out", tmp_path / "run", "--verbose")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[INFO]" in proc.stdout + proc.stderr  # DeepSpeed's launcher and engine lines
