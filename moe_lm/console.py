"""What reaches the console from the libraries moe-lm drives: DeepSpeed's INFO lines, its accelerator notice and
the print of its CPU communication op, and wandb's banners and summary stay off unless verbose (`--verbose`,
`logging.verbose=true`, or MOE_LM_VERBOSE=1 in the environment, which child processes inherit); their warnings
and errors always show. The project's own lines are never filtered.

DeepSpeed's launcher (`deepspeed ...`) is another program: it prints before moe-lm starts, unless started quiet
(`moe-lm train --nproc N` does; by hand: `deepspeed -q`, with DS_ACCELERATOR=cpu on a machine without a GPU).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings

VERBOSE = "MOE_LM_VERBOSE"
# DeepSpeed's one logger, and the warnings it gives on every run that are no news: its accelerator detection's on a
# CPU-only machine, and ZeRO-1 without contiguous gradients with MoE, which one rank runs on purpose (the weights are
# ZeRO-2's bit for bit: moe_lm/parallel/deepspeed_setup.py, zero_optimization)
DEEPSPEED_LOGGER = "DeepSpeed"
_NOTICES = ("Setting accelerator to CPU", "ZeRO Stage 1 has not been thoroughly tested with MoE")


def verbose() -> bool:
    return os.environ.get(VERBOSE, "") not in ("", "0")


def set_verbose(on: bool) -> None:
    """Verbose for this process and the processes it starts (on only: a verbose parent is never turned quiet)."""
    if on:
        os.environ[VERBOSE] = "1"
        quiet_deepspeed()


class _Notices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return verbose() or not record.getMessage().startswith(_NOTICES)


def quiet_deepspeed() -> None:
    """Drop DeepSpeed's routine notices unless verbose, or let its INFO lines through if verbose. Call before
    deepspeed is first imported (its accelerator notice comes at import) and again after (its import resets the
    level). Idempotent."""
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    if not any(isinstance(f, _Notices) for f in logger.filters):
        logger.addFilter(_Notices())
        if not verbose():  # DeepSpeed's ZeRO calls torch collectives torch has renamed: a warning every step
            warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    if verbose():
        for target in (logger, *logger.handlers):
            target.setLevel(logging.INFO)


@contextlib.contextmanager
def library_prints():
    """Within the block a library's own prints to stdout are held back unless verbose; shown if it fails."""
    if verbose():
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held):
            yield
    except BaseException:
        sys.stdout.write(held.getvalue())
        raise


@contextlib.contextmanager
def transformers_quiet():
    """transformers' progress bars (e.g. "Writing model shards") off within the block unless verbose."""
    from transformers.utils import logging as tf_logging

    was_on = tf_logging.is_progress_bar_enabled()
    if not verbose():
        tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            tf_logging.enable_progress_bar()
