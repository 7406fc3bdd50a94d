"""A run folder from someone else runs no code: every checkpoint file is read weights-only, by our tools and before
DeepSpeed's own unrestricted load; a file that fails is refused by name. Old checkpoints still load."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_lm.checkpoint.format import COMPLETE, complete_record
from moe_lm.config import ConfigError
from moe_lm.errors import RunError
from tests.helpers.runs import tiny_train_cfg, with_train

ROOT = Path(__file__).resolve().parents[2]


class Payload:
    """What an attacker pickles: unpickling it calls os.system."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def plant(path: Path, marker: Path) -> None:
    """Replace a checkpoint file with a pickle that would create `marker`, and make COMPLETE agree with it."""
    torch.save({"module": Payload(f"touch {marker}")}, path)
    (path.parent / COMPLETE).write_text(json.dumps(complete_record(path.parent)))


@pytest.fixture(scope="module")
def attacked(tmp_path_factory, tiny_data, trained_run):
    """A run whose newest checkpoint's model file is the attack (as in the report: COMPLETE updated): a copy of the
    shared run, which the attack must not reach."""
    root = tmp_path_factory.mktemp("attack")
    shutil.copytree(trained_run(max_steps=4, ckpt_interval=2), root / "run", symlinks=True)
    cfg = tiny_train_cfg(tiny_data, root / "run", max_steps=4, ckpt_interval=2)
    marker = root / "PWNED"
    plant(root / "run" / "checkpoints" / "step_00000004" / "mp_rank_00_model_states.pt", marker)
    return cfg, root / "run", marker


@pytest.mark.parametrize(
    "launch_script, extra",
    [("export_hf.py", ["--out", "{tmp}/hf"]), ("generate.py", ["--max-new-tokens", "3"]),
     ("analyze_routing.py", ["--out", "{tmp}/analysis", "--no-init-baseline"])],
)  # fmt: skip
def test_the_scripts_refuse_a_planted_pickle_and_run_none_of_it(attacked, launch_script, extra, tmp_path, cli):
    _, run, marker = attacked
    proc = cli.script(launch_script, "--run", run, *[a.format(tmp=tmp_path) for a in extra])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "mp_rank_00_model_states.pt holds an object of posix.system" in proc.stderr
    assert "nothing in it ran" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()


def test_resume_refuses_the_planted_file_and_falls_back(attacked, train, capsys):
    cfg, run, marker = attacked
    train(with_train(cfg, max_steps=5, ckpt_interval=0))
    out = capsys.readouterr().out
    assert "mp_rank_00_model_states.pt holds an object of posix.system" in out and "at step 2" in out
    assert not marker.exists()


def test_resume_never_hands_deepspeed_a_planted_optimizer_file(tmp_path, train, copied_run):
    cfg = copied_run(max_steps=2, ckpt_interval=2)
    folder = tmp_path / "run" / "checkpoints" / "step_00000002"
    plant(next(folder.glob("*optim_states.pt")), tmp_path / "PWNED")
    with pytest.raises(RunError, match="no checkpoint .* loads"):
        train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=3)))
    assert not (tmp_path / "PWNED").exists()


def test_init_from_a_checkpoint_with_a_planted_pickle_runs_none_of_it(tiny_data, tmp_path, train):
    from moe_lm.interop.hf import export_hf
    from moe_lm.model import initial_model

    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=1)
    source = tmp_path / "hf"
    export_hf(initial_model(dataclasses.replace(cfg, seed=0)), source)
    for f in source.glob("*.safetensors"):
        f.unlink()
    torch.save({"model.embed_tokens.weight": Payload(f"touch {tmp_path / 'PWNED'}")}, source / "pytorch_model.bin")
    init = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=f"hf:{source}"))
    with pytest.raises(ConfigError, match="weights-only load refuses; nothing in it ran"):
        train(init)
    assert not (tmp_path / "PWNED").exists()


def test_deepspeed_reads_weights_only_even_past_the_check(tmp_path, train, copied_run, monkeypatch):
    """Were a file swapped after verify_safe read it, DeepSpeed's own load (weights_only=False in its code) still
    runs none of it. The reference: without the forced weights-only load, the same resume does run the pickle."""
    from moe_lm.checkpoint import save_resume

    cfg = copied_run(max_steps=2, ckpt_interval=2)
    folder = tmp_path / "run" / "checkpoints" / "step_00000002"
    plant(next(folder.glob("*optim_states.pt")), tmp_path / "PWNED")
    monkeypatch.setattr(save_resume, "verify_safe", lambda folder: None)  # as if swapped right after the check
    resumed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=3))
    with pytest.raises(RunError, match="no checkpoint .* loads"):
        train(resumed)
    assert not (tmp_path / "PWNED").exists()
    monkeypatch.setattr(save_resume, "weights_only_everywhere", lambda allowed: contextlib.nullcontext())
    with pytest.raises(RunError):  # the payload runs, then DeepSpeed fails on what it returned
        train(resumed)
    assert (tmp_path / "PWNED").exists()  # the attack is real: the guard above is what stopped it


def as_numpy1_wrote_it(path: Path) -> None:
    """Spell numpy's array reconstruction as numpy 1 pickles it (numpy.core, not numpy 2's numpy._core)."""
    with zipfile.ZipFile(path) as z:
        entries = {info.filename: z.read(info) for info in z.infolist()}
    pkl = next(name for name in entries if name.endswith("/data.pkl"))
    assert b"numpy._core.multiarray\n_reconstruct" in entries[pkl]
    entries[pkl] = entries[pkl].replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    with zipfile.ZipFile(path, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)


@pytest.mark.parametrize("numpy_version", ["numpy 2", "numpy 1"])
def test_a_checkpoint_written_before_the_change_still_resumes(tmp_path, train, copied_run, numpy_version):
    """Sizes-only COMPLETE and RNG state with numpy arrays and Python tuples, as checkpoints were written before
    (pyproject allows numpy 1.26, whose pickles name numpy.core)."""
    cfg = copied_run(max_steps=2, ckpt_interval=2)
    folder = tmp_path / "run" / "checkpoints" / "step_00000002"
    np.random.seed(5)
    random.seed(5)
    old_rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    torch.save(old_rng, folder / "rng_rank0.pt")
    if numpy_version == "numpy 1":
        as_numpy1_wrote_it(folder / "rng_rank0.pt")
    (folder / COMPLETE).write_text(json.dumps({p.name: p.stat().st_size for p in sorted(folder.glob("*.pt"))}))
    np.random.seed(0)
    from moe_lm.checkpoint import save_resume

    class Engine:  # only the RNG part is under test here; DeepSpeed's load is exercised by the resume below
        def load_checkpoint(self, *args, **kwargs):
            return "ok", {}

    save_resume.load(Engine(), tmp_path / "run", "step_00000002")
    assert np.random.get_state()[1].tolist() == old_rng["numpy"][1].tolist() and random.getstate() == old_rng["python"]
    train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=3)))


def test_the_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    from moe_lm.checkpoint.format import safe_load
    from moe_lm.checkpoint.save_resume import _rng_state, _set_rng_state

    np.random.seed(3), random.seed(3), torch.manual_seed(3)
    np.random.normal(), random.gauss(0, 1)  # cached Gaussians are part of the state too
    torch.save(_rng_state(), tmp_path / "rng.pt")
    expected = (np.random.normal(size=3).tolist(), random.random(), random.gauss(0, 1), torch.rand(3).tolist())
    # no allowlist: tensors, numbers and strings only
    _set_rng_state(safe_load(tmp_path / "rng.pt"), tmp_path / "rng.pt")
    assert (np.random.normal(size=3).tolist(), random.random(), random.gauss(0, 1), torch.rand(3).tolist()) == expected
