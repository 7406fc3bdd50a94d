"""The analytics tests' shared run: a tiny model trained for 4 steps, with checkpoints at steps 2 and 4."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="package")
def tiny_run(trained_run) -> Path:
    """The session's shared run of these settings (read it, never write into it)."""
    return trained_run(max_steps=4, ckpt_interval=2, eval_interval=2)
