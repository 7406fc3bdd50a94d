"""The DeepSpeed engine as moe-lm uses it: the members train/, checkpoint/ and the evaluation call, named once.

`build_engine` (deepspeed_setup.py) returns a `deepspeed.DeepSpeedEngine`, which has these and far more; code
outside parallel/ is typed against this Protocol, so the seam to DeepSpeed is one short list, and a stand-in (a
test double, another engine) needs only these.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Engine(Protocol):
    optimizer: torch.optim.Optimizer  # its param_groups carry the scheduled learning rate

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...

    def backward(self, loss: torch.Tensor) -> Any: ...

    def step(self) -> None: ...

    def was_step_applied(self) -> bool: ...

    def get_global_grad_norm(self) -> float | None: ...

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict, save_latest: bool) -> Any: ...

    def load_checkpoint(
        self, load_dir: str, tag: str, load_optimizer_states: bool, load_lr_scheduler_states: bool
    ) -> tuple[str | None, dict]: ...


class StagedEngine(Engine, Protocol):
    """DeepSpeed's pipeline engine (`PipelineEngine`, `DualPipeVEngine`), as moe_lm/parallel/pipeline.py builds it:
    its backward and step raise; a step is `train_batch`, an evaluation `eval_batch`."""

    def train_batch(self, data_iter: Any) -> torch.Tensor: ...

    def eval_batch(self, data_iter: Any, num_micro_batches: int | None = None, bcast_loss: bool = True) -> Any: ...

    def reset_activation_shape(self) -> None: ...
