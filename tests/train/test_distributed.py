"""Two CPU processes under the real `deepspeed` launcher (gloo): the bias update and ZeRO-1/2 training."""

from __future__ import annotations

import json

import pytest

from moe_lm.config import dump_config
from tests.helpers.distributed import launch
from tests.helpers.runs import tiny_train_cfg

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("zero", [1, 2])
def test_bias_update_uses_global_counts_and_stays_identical(tmp_path, zero):
    out = tmp_path / "result.json"
    launch("tests/workers/dist_balance.py", "--zero", str(zero), "--out", str(out))
    assert json.loads(out.read_text()) == {"ok": True, "world": 2, "checks": 3, "zero": zero}


@pytest.mark.parametrize("zero", [1, 2])
def test_two_process_training_with_zero(tiny_data, tmp_path, zero):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=6, grad_accum_steps=1)
    dump_config(cfg, tmp_path / "cfg.yaml")
    proc = launch("launch/train.py", "--config", str(tmp_path / "cfg.yaml"), f"parallel.zero_stage={zero}")
    assert "world 2" in proc.stdout and f"ZeRO-{zero}" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 7))
    assert train[-1]["loss"] < train[0]["loss"]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step_00000006"
