"""Each old form moe-lm still reads (moe_lm/compat.py) loads in this release and, from SHIMS_UNTIL on, is an error
that names the file and what to do, instead of a silent second code path that nobody tests any more."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from moe_lm import compat
from moe_lm.analysis.recording import record_trace
from moe_lm.checkpoint.format import COMPLETE, damage
from moe_lm.checkpoint.save_resume import _set_rng_state
from moe_lm.data.prepare import load_split
from moe_lm.errors import DataError
from moe_lm.model import Transformer
from moe_lm.output_folder import made_by
from moe_lm.routing.torch_routing import transformer_routing
from moe_lm.routing.trace import Trace
from moe_lm.testing import tiny_model_cfg
from tests.data.test_data_faults import copy_prepared


def an_old_run(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000002")
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 4.0}) + "\n")
    return lambda: made_by(run)


def an_old_checkpoint(tmp_path):
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"abc")
    (tmp_path / COMPLETE).write_text(json.dumps({"mp_rank_00_model_states.pt": 3}))  # sizes, no hashes
    return lambda: damage(tmp_path)


def an_old_rng_file(tmp_path):
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    return lambda: _set_rng_state(state, tmp_path / "rng_rank0.pt")


def an_old_data_folder(tmp_path, tiny_data):
    data = copy_prepared(tiny_data, tmp_path)
    meta = json.loads((data / "meta.json").read_text())
    del meta["tokens_xxh3_128"]
    (data / "meta.json").write_text(json.dumps(meta))
    return lambda: load_split(data, "val")


def an_old_trace(tmp_path, version: int = 1):
    """A trace as format `version` wrote it: format 2 named its provenance `source` and held every column, format 1
    had no margins or log-probs (their files are simply not read)."""
    docs = [(0, np.arange(2, 30))]
    record_trace(transformer_routing(Transformer(tiny_model_cfg())), docs, tmp_path / "t", ["a"], seq_len=16,
                 progress=False)  # fmt: skip
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    meta["format_version"], meta["source"] = version, meta.pop("provenance")
    del meta["columns"]
    (tmp_path / "t" / "meta.json").write_text(json.dumps(meta))

    def read() -> Trace:
        trace = Trace(tmp_path / "t")
        assert trace.provenance == meta["source"] and trace.weights(trace.layers[0]) is not None
        assert (trace.logprob is not None) == (version == 2)
        return trace

    return read


OLD_FORMS = {
    "run without a marker": (an_old_run, "train on it with moe-lm 0.2 once"),
    "COMPLETE with sizes only": (an_old_checkpoint, "resume the run once with moe-lm 0.2"),
    "RNG state of numpy arrays": (an_old_rng_file, "resume the run once with moe-lm 0.2"),
    "data without token hashes": (an_old_data_folder, "moe-lm prepare --force"),
    "trace of format 1": (an_old_trace, "record it again"),
    "trace of format 2": (lambda tmp_path: an_old_trace(tmp_path, 2), "record it again"),
}


@pytest.mark.parametrize("form", OLD_FORMS)
def test_old_forms_load_until_their_release_then_say_what_to_do(form, tmp_path, tiny_data, monkeypatch):
    make, fix = OLD_FORMS[form]
    read = make(tmp_path, tiny_data) if form == "data without token hashes" else make(tmp_path)
    assert compat.release() < compat.SHIMS_UNTIL
    read()  # this release: it still loads
    monkeypatch.setattr(compat, "release", lambda: compat.SHIMS_UNTIL)
    said = f"{tmp_path}.* was written by an older moe-lm, which moe-lm 0.3 no longer reads: .*{fix}"
    with pytest.raises(DataError, match=said):
        read()
