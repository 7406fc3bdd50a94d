"""Training under DeepSpeed: the loop, evaluation, checkpoints, balancing, logging."""


class RunError(RuntimeError):
    """A run that cannot start or go on; the message says why and what to do (no traceback needed)."""
