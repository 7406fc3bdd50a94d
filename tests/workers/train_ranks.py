"""The training command on every rank of a forked job (tests/helpers/ranks.py), as `deepspeed launch/train.py`
runs it on each rank: `ranks(train_command, 2, "--config", cfg_file, "parallel.ep_size=2")`."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

from moe_lm.cli.train import main


def train_command(*argv) -> str:
    """`moe-lm train argv...` on this rank; what it printed (rank 0 prints the run's lines)."""
    out = io.StringIO()
    with redirect_stdout(out):
        main([str(a) for a in argv])
    return out.getvalue()
