"""torchtitan 0.3.0's model code where it was not released for: a torch without triton (a CPU build) and torch 2.11
(the GPU machine's; torchtitan 0.3.0 imports two things torch added in 2.12). Each stand-in is put in only where
the thing is missing, and only for what the bench's arm runs (its one-device model, no parallelism):

- without triton: `torchtitan.models.common` imports its expert-parallel triton kernels
  (models/common/moe.py -> token_dispatcher.py -> distributed/minimal_async_ep/kernels.py: `import triton`), which
  the one-device "standard" dispatcher never calls. For the import only, that one torchtitan module is a stand-in
  whose kernels raise if called. Not a stand-in for triton itself: torch's inductor asks `import triton` to decide
  what it can compile, and a fake one would break our compiled arm.
- torch < 2.12, `torch.distributed.fsdp.DataParallelMeshDims`: deepseek_v3/mtp.py imports it for the annotations of
  its FSDP helper. For the import only, an empty class of that name.
- torch < 2.12, `create_block_mask(separate_full_blocks=...)`: its FlexAttention mask asks for full blocks stored
  apart (True, unless in its batch-invariant mode), which is all torch 2.11 does. Its mask builder is given a call
  that drops the True and refuses False.

Checked with torch 2.11.0 (Python 3.12, triton 3.6) on the CPU: the arm builds, steps, gives our logits (4.8e-7 in
fp32 with its eps and bf16 casts set to ours) and its FlexAttention forward equals the one under torch 2.13.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
import types
import warnings

TRITON_ONLY = "torchtitan.distributed.minimal_async_ep.kernels"


def import_torchtitan() -> types.SimpleNamespace:
    """The torchtitan modules the arm uses, importable here."""
    with _without_triton(), _fsdp_mesh_dims():
        from torchtitan.components.loss import cross_entropy_loss
        from torchtitan.models import common
        from torchtitan.models.common import attention
        from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers
        from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
    _full_blocks_apart(attention)
    # why: its router runs under autocast(float32), which torch's CPU autocast says it cannot do (a warning every
    # step; the router computes in fp32 all the same)
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    return types.SimpleNamespace(
        common=common, sdpa=attention.ScaledDotProductAttention, Model=DeepSeekV3Model, layers=_build_dsv3_layers,
        Adapter=DeepSeekV3StateDictAdapter, cross_entropy_loss=cross_entropy_loss,
    )  # fmt: skip


@contextlib.contextmanager
def _without_triton():
    if importlib.util.find_spec("triton") is not None or TRITON_ONLY in sys.modules:
        yield
        return
    stand_in = types.ModuleType(TRITON_ONLY)
    stand_in.__getattr__ = _kernel
    sys.modules[TRITON_ONLY] = stand_in
    try:
        yield
    finally:
        del sys.modules[TRITON_ONLY]


def _kernel(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise RuntimeError(f"torchtitan's {name} needs triton (expert parallelism), which is not installed")

    return missing


@contextlib.contextmanager
def _fsdp_mesh_dims():
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):
        yield
        return
    fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})
    try:
        yield
    finally:
        del fsdp.DataParallelMeshDims


def _full_blocks_apart(attention: types.ModuleType) -> None:
    """torchtitan's compiled `create_block_mask`, callable with `separate_full_blocks` where torch lacks it."""
    from torch.nn.attention.flex_attention import create_block_mask

    if "separate_full_blocks" in inspect.signature(create_block_mask).parameters:
        return
    compiled = attention._compiled_create_block_mask
    if getattr(compiled, "full_blocks_apart", False):
        return

    def older_torch(*args, separate_full_blocks: bool = True, **kwargs):
        if not separate_full_blocks:
            raise RuntimeError("torchtitan's batch-invariant FlexAttention mask needs torch >= 2.12")
        return compiled(*args, **kwargs)

    older_torch.full_blocks_apart = True
    attention._compiled_create_block_mask = older_torch
