"""Checkpoints that survive crashes: DeepSpeed state plus our run state, a pointer that moves last, and resume.

The layout on disk (and how to read it without DeepSpeed) is moe_lm/interop/ds_checkpoint.py. A kill at any
moment leaves `latest` naming a complete checkpoint (or nothing): the pointer is replaced with os.replace only
after all ranks finished writing, and older checkpoints are pruned only after that.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moe_lm.config import Config, config_to_dict, dump_config, load_config
from moe_lm.interop.ds_checkpoint import COMPLETE, ckpt_root, data_reference, latest_tag

# Sections whose change makes an existing checkpoint a different experiment (the rest may change on resume).
RESUME_MUST_MATCH = ("model", "data")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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


def resume(engine, cfg: Config, run_dir: Path, log) -> tuple[int, int]:
    """Restore the run's latest checkpoint into `engine` if there is one: (step, samples consumed), (0, 0) if not.

    The checkpoint must belong to the same experiment (RESUME_MUST_MATCH). Saved at another ep_size, its weights
    load with a fresh optimizer state (DeepSpeed cannot re-shard it). `log` prints on rank 0.
    """
    tag = latest_tag(run_dir)
    if tag is None:
        return 0, 0
    saved = load_config(ckpt_root(run_dir) / tag / "config.yaml")
    changed = [s for s in RESUME_MUST_MATCH if config_to_dict(saved)[s] != config_to_dict(cfg)[s]]
    if changed:
        raise RuntimeError(
            f"{run_dir} holds a run with different {' and '.join(changed)} settings; resume it with its own config "
            f"({run_dir / 'config.yaml'}), pick another train.out_dir, or pass train.resume=false to start afresh"
        )
    same_ep = saved.parallel.ep_size == cfg.parallel.ep_size
    if not same_ep:
        log(
            f"warning: {tag} was saved at parallel.ep_size={saved.parallel.ep_size}; loading its weights at "
            f"ep_size={cfg.parallel.ep_size} with a fresh optimizer state (DeepSpeed cannot re-shard it)"
        )
    state = load(engine, run_dir, tag, load_optimizer_states=same_ep)
    log(f"resumed from {ckpt_root(run_dir) / tag} at step {state['step']}")
    return state["step"], state["samples"]


def move_aside(run_dir: Path, log) -> None:
    """train.resume=false: move an existing run folder to <run>.prev-<time> (rank 0), so that nothing is lost."""
    has_run = (ckpt_root(run_dir)).is_dir() or (run_dir / "metrics.jsonl").is_file()
    if has_run and _rank() == 0:
        aside = run_dir.with_name(f"{run_dir.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.move(str(run_dir), str(aside))
        log(f"train.resume=false: moved the previous run to {aside}")
    _barrier()


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
