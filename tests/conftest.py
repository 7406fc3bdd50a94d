"""Shared fixtures: a seeded RNG, a quiet console, and the tiny prepared corpus (tests/helpers/runs.py builds it)."""

from __future__ import annotations

import pytest
import torch

from moe_lm.config import DataConfig
from moe_lm.data.prepare import prepare_data
from tests.helpers.runs import VOCAB, write_folder_corpus


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    """A test that trains with logging.verbose (which marks the process verbose) leaves the next one quiet."""
    monkeypatch.delenv("MOE_LM_VERBOSE", raising=False)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_data")
    corpus = write_folder_corpus(root / "corpus", n_docs=12)
    cfg = DataConfig(sources=[str(corpus)], out_dir=str(root / "prepared"), val_fraction=0.2)
    prepare_data(cfg, vocab_size=VOCAB, log=lambda s: None)
    return cfg
