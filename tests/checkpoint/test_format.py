"""Reading a run's checkpoints without DeepSpeed: the offline loader, RUN[:TAG], and the import boundary."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from moe_lm.checkpoint.format import RunRef, load_model, parse_run


def test_parse_run():
    assert parse_run("runs/tiny") == RunRef(Path("runs/tiny"), None)
    assert parse_run("runs/tiny:step_00000500") == RunRef(Path("runs/tiny"), "step_00000500")


@pytest.fixture(scope="module")
def run(trained_run) -> Path:
    """A run saved by the DeepSpeed engine at steps 1 and 2 (shared: read only)."""
    return trained_run(max_steps=2, ckpt_interval=1, keep_last=2)


def test_offline_loading_never_imports_deepspeed(run, process, tmp_path):
    """load_model works in a process where deepspeed cannot be imported, and gives the engine's weights; an eager
    forward never loads torch's compiler (torch._dynamo: 2 s at the start of every command) (the subject is a fresh
    interpreter's imports: a process of its own)."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["deepspeed"] = None  # any import of deepspeed now raises ImportError
        import torch
        from moe_lm.checkpoint.format import load_model
        from moe_lm.analysis import report  # the analytics' modules as well
        from moe_lm.routing import trace
        cfg, model, tag = load_model({str(run)!r})
        torch.save(model.state_dict(), {str(tmp_path / "offline.pt")!r})
        model(torch.tensor([[1, 2, 3]]))
        print(tag, "torch._dynamo" in sys.modules)
        """
    )
    out = process.python(script, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "step_00000002 False"
    _, model, _ = load_model(run)
    offline = torch.load(tmp_path / "offline.pt")
    assert offline.keys() == model.state_dict().keys()
    assert all(torch.equal(offline[k], v) for k, v in model.state_dict().items())


def test_a_wrong_tag_lists_the_complete_checkpoints(run):
    listed = r"step_00000009 is not a complete checkpoint.*step_00000001, step_00000002"
    with pytest.raises(FileNotFoundError, match=listed):
        load_model(run, "step_00000009")
