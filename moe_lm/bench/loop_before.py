"""The training loop's step as it was before issue 65's work on the loop, kept for `moe-lm bench loop --before` only
(never used in training), so that one interleaved run times today's loop against it beside the model step:

- one rank ran ZeRO-2 with contiguous gradients (today ZeRO-1 without them: `zero_optimization`);
- the AdamW was fused on CUDA only (today on the CPU too);
- every step computed the row's routing numbers (MaxVio, bias statistics) and waited for the counts on the host;
- on one rank the signal check went through a tensor and `.item()`, the losses through an all-reduce;
- each micro-batch went to a GPU from pageable memory (a copy that waits for the queued work).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from moe_lm.bench.loop_steps import LoopStep


class LoopBefore(LoopStep):
    """`LoopStep` with the loop's behaviour before issue 65; `as_before()` holds it (its steps enter it themselves)."""

    def __init__(self, *args) -> None:
        from moe_lm.parallel import deepspeed_setup

        with _patched(deepspeed_setup, "zero_optimization", _zero_as_before):
            super().__init__(*args)
        if next(self.run.model.parameters()).device.type != "cuda":  # AdamW(fused=False) as it was built
            for group in self.run.engine.optimizer.optimizer.param_groups:  # ZeRO's own optimizer's groups
                group["fused"], group["foreach"] = False, None
        self.stop.requested = _requested_as_before.__get__(self.stop)
        self._held = False

    @contextlib.contextmanager
    def as_before(self) -> Iterator[None]:
        """The loop's module functions as they were, within the block (re-entered: nothing more)."""
        if self._held:
            yield
            return
        from moe_lm.train import loop, step

        with contextlib.ExitStack() as stack:
            stack.enter_context(_patched(step, "_step_losses", _step_losses_as_before(step._step_losses)))
            stack.enter_context(_patched(loop, "balance_step", _balance_every_step(loop.balance_step)))
            stack.enter_context(_patched(loop, "to_device", lambda batch, dev: batch.to(dev)))
            self._held = True
            try:
                yield
            finally:
                self._held = False

    def steps(self, first_step: int, n: int) -> None:
        with self.as_before():
            super().steps(first_step, n)


def _zero_as_before(p, world: int) -> dict:
    return {"stage": p.zero_stage, "contiguous_gradients": True, "reduce_scatter": True, "overlap_comm": False}


def _requested_as_before(self, device) -> int:  # one rank (the benchmark's): no all-reduce, but the tensor's wait
    return int(torch.tensor([self.signum], device=device).item())


def _step_losses_as_before(step_losses):
    def with_all_reduce(engine, sums: torch.Tensor) -> tuple[dict, bool]:
        dist.all_reduce(sums)  # on one rank too
        return step_losses(engine, sums)

    return with_all_reduce


def _balance_every_step(balance_step):
    def every_step(model, speed, apply=True, metrics=True):
        return balance_step(model, speed, apply)  # the routing numbers whether the row is logged or not

    return every_step


@contextlib.contextmanager
def _patched(owner, name: str, value) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)
