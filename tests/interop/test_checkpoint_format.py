"""Reading a run's checkpoints without DeepSpeed: the offline loader, RUN[:TAG], and the import boundary."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moe_lm.checkpoint.format import RunRef, load_model, parse_run
from moe_lm.train import loop
from tests.helpers.runs import tiny_train_cfg

ROOT = Path(__file__).resolve().parents[2]


def test_parse_run():
    assert parse_run("runs/tiny") == RunRef(Path("runs/tiny"), None)
    assert parse_run("runs/tiny:step_00000500") == RunRef(Path("runs/tiny"), "step_00000500")


@pytest.fixture(scope="module")
def trained_run(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("ds_ckpt") / "run"
    loop.train(tiny_train_cfg(tiny_data, run, max_steps=2, ckpt_interval=1, keep_last=2))
    return run


def test_offline_loading_never_imports_deepspeed(trained_run):
    """load_model works in a process where deepspeed cannot be imported, and gives the engine's weights."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["deepspeed"] = None  # any import of deepspeed now raises ImportError
        import torch
        from moe_lm.checkpoint.format import load_model
        from moe_lm.analysis import report, trace  # the analytics' modules as well
        cfg, model, tag = load_model({str(trained_run)!r})
        torch.save(model.state_dict(), {str(trained_run / "offline.pt")!r})
        print(tag)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "step_00000002"
    _, model, _ = load_model(trained_run)
    offline = torch.load(trained_run / "offline.pt")
    assert offline.keys() == model.state_dict().keys()
    assert all(torch.equal(offline[k], v) for k, v in model.state_dict().items())


def test_a_wrong_tag_lists_the_complete_checkpoints(trained_run):
    listed = r"step_00000009 is not a complete checkpoint.*step_00000001, step_00000002"
    with pytest.raises(FileNotFoundError, match=listed):
        load_model(trained_run, "step_00000009")
