"""The pruning tests' shared run: 16 routed experts in 4 groups, top-2 groups, trained 2 steps (a model change, so
not one of the session's shared trained runs), trained once for the session and only read."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers.pruned_sources import fp8_release, gguf_sources
from tests.helpers.runs import tiny_train_cfg


@pytest.fixture(scope="session")
def grouped_run(tmp_path_factory, tiny_data, train):
    """A run of 16 routed experts in 4 groups, top-2 groups (read it, never write into it)."""
    run = tmp_path_factory.mktemp("prune") / "run"
    cfg = tiny_train_cfg(tiny_data, run, max_steps=2)
    moe = dataclasses.replace(cfg.model.moe, n_routed_experts=16, n_group=4, topk_group=2)
    train(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe)))
    return run


@pytest.fixture(scope="session")
def ggufs(tiny_data, tmp_path_factory):
    """A check-sized MLA model (its matrices scaled, biases non-zero) with 16 experts in 4 groups: the folder holding
    hf/ (a transformers export with the tiny corpus' tokenizer), f32.gguf and q8_0.gguf (only read)."""
    return gguf_sources(tmp_path_factory.mktemp("gguf"), tiny_data)


@pytest.fixture(scope="session")
def release16(tmp_path_factory):
    """A DeepSeek-V3 FP8 release (MoE layers 1..3, 16 experts in 4 groups, 3 shards, a tokenizer; only read)."""
    return fp8_release(tmp_path_factory.mktemp("fp8") / "release")
