"""The analytics tests' shared run: a tiny model trained for 4 steps, with checkpoints at steps 2 and 4."""

from __future__ import annotations

import pytest

from moe_lm.train import loop
from tests.helpers.runs import tiny_train_cfg


@pytest.fixture(scope="package")
def tiny_run(tmp_path_factory, tiny_data):
    run = tmp_path_factory.mktemp("analysis") / "run"
    cfg = tiny_train_cfg(tiny_data, run, max_steps=4, ckpt_interval=2, eval_interval=2)
    loop.train(cfg)
    return run
