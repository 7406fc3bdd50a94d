"""Memory and speed transforms of a built model, applied from outside before the engine wraps it (the model code
is untouched, its state-dict keys too): activation checkpointing and torch.compile of the blocks.

- Activation checkpointing (`performance.activation_checkpointing`): "full" recomputes every block's forward during
  backward instead of keeping its activations; "selective" only the blocks with an MoE FFN (whose K experts' wide
  intermediate activations are the largest per token); "none" keeps everything. torch.utils.checkpoint with
  use_reentrant=False. The routers' token counts stay right: a router does not count during the recompute
  (moe_lm/model/router.py), so the bias update sees each token once.
- Compile (`performance.compile`): torch.compile of every block (attention, norms, residuals, dense MLPs), in place
  (nn.Module.compile, so checkpoints keep their keys); the MoE FFN inside a block runs eagerly (a graph break),
  since its routing has data-dependent shapes and, on CPU, calls our compiled C++ kernels.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from moe_lm.model import MoE


def apply_activation_checkpointing(model, mode: str):
    """Recompute the chosen blocks in backward ("full": all, "selective": MoE blocks, "none": no change)."""
    if mode == "none":
        return model
    for block in model.blocks():
        if mode == "full" or isinstance(block.mlp, MoE):
            block.forward = _recomputed(block.forward)
    return model


def _recomputed(forward):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def compiles(setting: str | bool, device: torch.device) -> bool:
    """Whether performance.compile compiles on `device` ("auto": on a CUDA GPU)."""
    return setting is True or (setting == "auto" and device.type == "cuda")


def apply_compile(model, enabled: bool):
    """torch.compile each block in place, its MoE FFN excluded (run eagerly)."""
    if not enabled:
        return model
    for block in model.blocks():
        if isinstance(block.mlp, MoE):
            block.mlp.forward = torch.compiler.disable(block.mlp.forward)
        block.compile()
    return model
