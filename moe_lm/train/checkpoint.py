"""Checkpoints that survive crashes: DeepSpeed state plus our run state, and a pointer that moves last.

    <run>/checkpoints/step_00000200/    DeepSpeed's files (model, optimizer; experts per rank), config.yaml,
                                        rng_rank<r>.pt, and COMPLETE once every rank has finished
    <run>/checkpoints/latest            the tag of the newest COMPLETE checkpoint, replaced atomically

A kill at any moment leaves `latest` naming a complete checkpoint (or nothing): the pointer is replaced with
os.replace only after all ranks finished writing, and older checkpoints are pruned only after that.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moe_lm.config import Config, dump_config, load_config
from moe_lm.model import Transformer
from moe_lm.parallel.expert_parallel import plain_state_dict

COMPLETE = "COMPLETE"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def ckpt_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def latest_tag(run_dir: Path) -> str | None:
    pointer = ckpt_root(run_dir) / "latest"
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    if not (ckpt_root(run_dir) / tag / COMPLETE).is_file():
        raise RuntimeError(f"{pointer} names {tag}, which is not a complete checkpoint; the run folder was altered")
    return tag


def save(engine, run_dir: Path, step: int, cfg: Config, client_state: dict, keep_last: int) -> str:
    """Save on every rank; rank 0 then marks it complete, moves the pointer, and prunes old checkpoints."""
    root = ckpt_root(run_dir)
    tag = f"step_{step:08d}"
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    torch.save(_rng_state(), root / tag / f"rng_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        dump_config(cfg, root / tag / "config.yaml")
        (root / tag / "data_ref.json").write_text(json.dumps(data_reference(cfg)))
        (root / tag / COMPLETE).touch()
        tmp = root / "latest.tmp"
        tmp.write_text(tag)
        with open(tmp) as f:
            os.fsync(f.fileno())
        os.replace(tmp, root / "latest")
        _prune(root, keep_last, tag)
    _barrier()
    return tag


def load(engine, run_dir: Path, tag: str, load_optimizer_states: bool = True) -> dict:
    """Restore engine state and this rank's RNG from checkpoint `tag`; returns the client state."""
    root = ckpt_root(run_dir)
    path, client_state = engine.load_checkpoint(
        str(root), tag=tag, load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=False
    )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {root / tag}")
    rng_file = root / tag / f"rng_rank{_rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state


def _prune(root: Path, keep_last: int, current: str) -> None:
    tags = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))
    complete = [p for p in tags if (p / COMPLETE).is_file()]
    keep = {p.name for p in complete[-keep_last:]} | {current}
    for p in tags:
        # incomplete folders are leftovers of interrupted saves; older complete ones fall out of keep_last
        if p.name not in keep and p.name < current:
            shutil.rmtree(p, ignore_errors=True)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def data_reference(cfg: Config) -> dict:
    """Where the run's data and tokenizer are (absolute), and the tokenizer's hash."""
    data_dir = Path(cfg.data.out_dir).resolve()
    tok = data_dir / "tokenizer.model"
    return {
        "data_dir": str(data_dir),
        "tokenizer_sha256": hashlib.sha256(tok.read_bytes()).hexdigest() if tok.is_file() else None,
    }


def _resolve_data(cfg: Config, folder: Path) -> Config:
    """The checkpoint's config with data.out_dir pointing at the data it was trained on, wherever we run from."""
    ref_file = folder / "data_ref.json"
    if not ref_file.is_file():
        return cfg
    ref = json.loads(ref_file.read_text())
    tok = Path(ref["data_dir"]) / "tokenizer.model"
    if (
        ref["tokenizer_sha256"]
        and tok.is_file()
        and hashlib.sha256(tok.read_bytes()).hexdigest() != ref["tokenizer_sha256"]
    ):
        raise ValueError(
            f"{tok} is not the tokenizer this checkpoint was trained with (the data was rebuilt); "
            f"prepare the data again with the run's config.yaml"
        )
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, out_dir=ref["data_dir"]))


def load_model(run_dir: str | Path, tag: str | None = None):
    """(config, Transformer in eval mode, tag) from a run's checkpoint (the latest complete one by default), on CPU,
    without DeepSpeed: for generation, analytics and export."""
    run_dir = Path(run_dir)
    tag = tag or latest_tag(run_dir)
    if tag is None:
        raise FileNotFoundError(f"no complete checkpoint in {run_dir / 'checkpoints'} (train first, or check the path)")
    folder = ckpt_root(run_dir) / tag
    cfg = _resolve_data(load_config(folder / "config.yaml"), folder)
    # DeepSpeed's own files; they hold non-tensor objects, hence weights_only=False (the user's own checkpoint)
    state = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    for expert_file in sorted(folder.glob("layer_*_expert_*_mp_rank_00_model_states.pt")):
        state.update(torch.load(expert_file, map_location="cpu", weights_only=False))
    if cfg.model.moe.experts_impl == "megablocks":
        # why: offline tools run on CPU, and the weights do not depend on the expert backend
        cfg.model.moe.experts_impl = "grouped"
    model = Transformer(cfg.model)
    model.load_state_dict({k: v.float() for k, v in plain_state_dict(state, model.state_dict()).items()})
    return cfg, model.eval(), tag
