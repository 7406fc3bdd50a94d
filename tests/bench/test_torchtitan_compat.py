"""The stand-ins that let torchtitan 0.3.0's model code import on torch 2.11 (the GPU machine's) behave as
moe_lm/bench/torchtitan_compat.py says: each is put in only where torch lacks the thing, and only what torchtitan's
one-device model needs. (The whole arm ran on torch 2.11.0 on the CPU once, docs/gpu.md §3; this suite runs torch
2.13, which has both, so here torch 2.11 is played by removing them.)"""

from __future__ import annotations

import types

import pytest
import torch.distributed.fsdp as fsdp
import torch.nn.attention.flex_attention as flex

from moe_lm.bench import torchtitan_compat as compat


def test_the_fsdp_class_torchtitan_names_stands_in_for_the_import_only(monkeypatch):
    monkeypatch.delattr(fsdp, "DataParallelMeshDims", raising=False)
    with compat._fsdp_mesh_dims():
        from torch.distributed.fsdp import DataParallelMeshDims  # what deepseek_v3/mtp.py imports

        assert isinstance(DataParallelMeshDims, type)
    assert not hasattr(fsdp, "DataParallelMeshDims")


def test_a_mask_with_full_blocks_apart_is_what_an_older_create_block_mask_builds(monkeypatch):
    """torch 2.11's create_block_mask has no `separate_full_blocks` and always stores full blocks apart: torchtitan's
    True is dropped, its batch-invariant False refused."""

    def older(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False):
        raise AssertionError("torchtitan calls its compiled copy")

    monkeypatch.setattr(flex, "create_block_mask", older)
    calls = []
    attention = types.SimpleNamespace(_compiled_create_block_mask=lambda *a, **k: calls.append((a, k)) or "mask")
    compat._full_blocks_apart(attention)
    compat._full_blocks_apart(attention)  # once only, however often torchtitan is imported
    assert attention._compiled_create_block_mask("mod", 2, separate_full_blocks=True, BLOCK_SIZE=128) == "mask"
    assert calls == [(("mod", 2), {"BLOCK_SIZE": 128})]
    with pytest.raises(RuntimeError, match="needs torch >= 2.12"):
        attention._compiled_create_block_mask("mod", 2, separate_full_blocks=False)
