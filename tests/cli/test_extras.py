"""The optional extras: a plain training run works without any of them, and a feature whose extra is missing says
which extra brings it (`pip install -e '.[...]'`) (one line, exit code 2). The packages are hidden from a fresh process
by an import hook, as if they were not installed."""

from __future__ import annotations

import sys

import pytest

from moe_lm.config import dump_config
from tests.helpers.runs import tiny_train_cfg

HIDDEN = ("wandb", "tensorboard", "datasets", "pyarrow", "matplotlib")
HIDE = f"""
import importlib.abc, sys
class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {HIDDEN!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Hidden())
from moe_lm.cli.main import main
main(sys.argv[1:])
"""


def without_extras(process, *args, cwd=None):
    """`moe-lm args...` in a fresh interpreter that cannot import the extras' packages (this process has imported
    some of them already, so the hook must be in place before anything is imported: a process of its own)."""
    return process.run([sys.executable, "-c", HIDE, *args], cwd=cwd)


@pytest.fixture(scope="module")
def run_config(tiny_data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("extras")
    cfg = tiny_train_cfg(tiny_data, folder / "run", max_steps=2, eval_interval=2, ckpt_interval=2)
    dump_config(cfg, folder / "cfg.yaml")
    return folder


def test_a_plain_run_trains_without_any_extra_and_says_wandb_is_missing(process, run_config):
    proc = without_extras(process, "train", "--config", run_config / "cfg.yaml", "logging.wandb_mode=offline")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "note: logging.wandb_mode=offline needs wandb: pip install -e '.[wandb]' in the moe-lm checkout" in proc.stdout
    )
    assert (run_config / "run" / "metrics.jsonl").is_file() and not (run_config / "run" / "wandb").exists()


@pytest.mark.parametrize(
    "args, extra",
    [
        (["train", "logging.tensorboard=true", "--out", "{tmp}/tb"], "tensorboard"),
        (["prepare", "data.sources=[{tmp}/corpus.parquet]", "--out", "{tmp}/data"], "datasets"),
        (["analyze", "--run", "{tmp}/run", "--out", "{tmp}/analysis"], "analysis"),
    ],
    ids=["tensorboard", "datasets", "analysis"],
)
def test_a_feature_without_its_extra_names_the_install_command(process, run_config, args, extra):
    (run_config / "corpus.parquet").write_bytes(b"PAR1")  # never read: the reader is missing first
    if args[0] == "train":
        args = [*args, "--config", str(run_config / "cfg.yaml")]
    proc = without_extras(process, *[a.format(tmp=run_config) for a in args])
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"pip install -e '.[{extra}]'" in errors[0], proc.stderr[-3000:]
