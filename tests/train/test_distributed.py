"""Two ranks over gloo (forked, tests/helpers/ranks.py): the bias update and ZeRO-1/2 training through the training
command."""

from __future__ import annotations

import json

import pytest

from moe_lm.config import dump_config
from tests.helpers.runs import tiny_train_cfg
from tests.workers.dist_balance import bias_update_checks
from tests.workers.train_ranks import train_command


@pytest.mark.parametrize("zero", [1, 2])
def test_bias_update_uses_global_counts_and_stays_identical(ranks, zero):
    assert ranks(bias_update_checks, 2, zero)[0] == {"ok": True, "world": 2, "checks": 3, "zero": zero}


@pytest.mark.parametrize("zero", [1, 2])
def test_two_process_training_with_zero(tiny_data, tmp_path, ranks, zero):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=6, grad_accum_steps=1)
    dump_config(cfg, tmp_path / "cfg.yaml")
    printed = ranks(train_command, 2, "--config", tmp_path / "cfg.yaml", f"parallel.zero_stage={zero}")[0]
    assert "world 2" in printed and f"ZeRO-{zero}" in printed
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 7))
    assert train[-1]["loss"] < train[0]["loss"]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step_00000006"
