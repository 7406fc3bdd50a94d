"""TensorBoard gets what wandb and metrics.jsonl get, read back with TensorBoard's own event reader; wandb stays
off the console unless asked."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers.runs import tiny_train_cfg


def with_logging(cfg, **changes):
    return dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, **changes))


def test_tensorboard_holds_every_logged_scalar_and_the_expert_loads(tiny_data, tmp_path, train):
    cfg = with_logging(tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=4, eval_interval=2), tensorboard=True)
    train(cfg)
    events = EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={"scalars": 0, "histograms": 0}).Reload()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    tags = set(events.Tags()["scalars"])
    expected = 0
    for row in rows:
        for key, value in row.items():
            if key in ("kind", "step") or not isinstance(value, int | float):
                continue
            tag = f"{row['kind']}/{key}"
            logged = {e.step: e.value for e in events.Scalars(tag)}
            assert logged[row["step"]] == pytest.approx(float(value), rel=1e-6, abs=1e-6), tag  # stored as float32
            expected += 1
    assert expected > 50 and {"train/loss", "eval/loss", "eval/maxvio_global/layer_1"} <= tags
    assert any(t.startswith("eval/loss/") for t in tags)  # per domain
    histogram = events.Histograms("expert_load/layer_1")[-1]
    assert histogram.step == 4
    counts = np.array(histogram.histogram_value.bucket)
    # the histogram's buckets are the experts; a step routes every token of the batch to k experts
    tokens = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.train.seq_len
    assert len(counts) == cfg.model.moe.n_routed_experts and counts.sum() == tokens * cfg.model.moe.num_experts_per_tok


def test_a_resumed_run_has_one_value_per_step_in_tensorboard(tiny_data, tmp_path, train):
    cfg = with_logging(tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=3, ckpt_interval=3), tensorboard=True)
    train(cfg)
    train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=6)))
    events = EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={"scalars": 0}).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]


def test_wandb_banners_stay_off_the_console_unless_asked(tiny_data, tmp_path, train, capfd):
    cfg = with_logging(tiny_train_cfg(tiny_data, tmp_path / "quiet", max_steps=1), wandb_mode="offline")
    train(cfg)
    quiet = capfd.readouterr()
    train(with_logging(tiny_train_cfg(tiny_data, tmp_path / "loud", max_steps=1), wandb_mode="offline", verbose=True))
    loud = capfd.readouterr()
    banner = "wandb: Run data is saved locally"
    assert banner not in quiet.out + quiet.err and banner in loud.out + loud.err
    assert list((tmp_path / "quiet" / "wandb").glob("offline-run-*"))  # quiet, but the run is still recorded


def test_a_dead_wandb_service_is_said_once_and_the_run_logs_on(tiny_data, tmp_path, capsys):
    """A terminal's Ctrl-C (or a launcher terminating everything below a rank) can end wandb's service first: the
    rank must go on to its checkpoint, with every row still in metrics.jsonl."""
    from moe_lm.train.tracker import Tracker

    class GoneService:
        def log(self, data, step):
            raise BrokenPipeError(32, "Broken pipe")

        def finish(self):
            raise AssertionError("finish after the service failed")

    tracker = Tracker(tiny_train_cfg(tiny_data, tmp_path / "run"), tmp_path, enabled=True)
    tracker.wandb = GoneService()
    for step in (1, 2, 3):
        tracker.log({"kind": "train", "step": step, "loss": 1.0})
    tracker.finish()
    said = capsys.readouterr().out
    assert said.count("wandb stopped logging (BrokenPipeError") == 1
    assert [json.loads(r)["step"] for r in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
