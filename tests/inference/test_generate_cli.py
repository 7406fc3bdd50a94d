"""The scripts on a run trained with MTP: speculative generation through the CLI (greedy: the plain output),
export, and the routing analytics (which cover the decoder's layers); generation beside a training that rotates
checkpoints away."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from moe_lm.checkpoint import format as checkpoint_format
from moe_lm.config import MTPConfig
from tests.helpers.runs import tiny_train_cfg


@pytest.fixture(scope="module")
def mtp_run(tmp_path_factory, tiny_data, train):
    # why its own training: MTP changes the model, which a shared trained_run (train/cadence settings) cannot
    run = tmp_path_factory.mktemp("mtp") / "run"
    cfg = tiny_train_cfg(tiny_data, run, max_steps=6)
    train(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mtp=MTPConfig(depth=2))))
    return run


def test_speculative_generation_cli_equals_plain_greedy(cli, mtp_run):
    args = ("--run", mtp_run, "--prompt", "the bond", "--max-new-tokens", "20", "--temperature", "0")
    plain, spec = cli.script("generate.py", *args), cli.script("generate.py", *args, "--speculative", "mtp")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr[-2000:] + spec.stderr[-2000:]
    assert spec.stdout == plain.stdout and spec.stdout.startswith("the bond")
    assert "drafts accepted: depth 1" in spec.stderr and "main-model passes" in spec.stderr
    sampled = cli.script("generate.py", *args[:-2], "--speculative", "mtp", "--draft-depth", "1", "--seed", "3")
    assert sampled.returncode == 0, sampled.stderr[-2000:]


def test_speculative_generation_without_mtp_modules_is_a_clear_error(cli, trained_run):
    proc = cli.script("generate.py", "--run", trained_run(max_steps=2), "--speculative", "mtp")
    assert proc.returncode != 0 and "no MTP modules" in proc.stderr and "Traceback" not in proc.stderr


def test_export_and_analytics_of_an_mtp_run(cli, mtp_run, tmp_path):
    proc = cli.script("export_hf.py", "--run", mtp_run, "--out", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 2
    proc = cli.script("analyze_routing.py", "--run", mtp_run, "--out", tmp_path / "report", "--no-init-baseline")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "report" / "metrics.json").read_text())
    assert metrics["trace"]["layers"] == [1]  # the decoder's MoE layer; the MTP blocks do not run at inference


def test_generate_reads_the_newest_checkpoint_when_a_running_training_rotates_the_one_it_reads(
    cli, copied_run, monkeypatch
):
    """While generate reads step 6, a training beside it saves step 9 and removes step 6 (cadence.keep_last)."""
    root = Path(copied_run().train.out_dir) / "checkpoints"
    real = checkpoint_format.safe_load

    def rotated_while_read(path, *args, **kwargs):
        if path.parent.name != "step_00000009":  # the training saves step 9, then removes the one being read
            if not (root / "step_00000009").exists():
                shutil.copytree(root / "step_00000006", root / "step_00000009")
                (root / "latest").write_text("step_00000009")
            shutil.rmtree(path.parent)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_format, "safe_load", rotated_while_read)
    args = ("--prompt", "the bond", "--max-new-tokens", "3", "--temperature", "0")
    proc = cli("generate", "--run", root.parent, *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("the bond")
    assert proc.stderr.splitlines() == [
        f"note: checkpoint {root / 'step_00000006'} was rotated away by the running training (cadence.keep_last) "
        "while it was read; reading the newest one"
    ]
    # a checkpoint asked for by its tag is not replaced by another: the error says what happened to it
    proc = cli("generate", "--run", f"{root.parent}:step_00000003", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith(
        f"error: checkpoint {root / 'step_00000003'} was rotated away by the running training (cadence.keep_last) "
        "while it was read; complete ones now: step_00000009"
    )
