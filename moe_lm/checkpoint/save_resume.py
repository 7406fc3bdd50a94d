"""Checkpoints that survive crashes, faults and signals: save and resume.

The layout on disk (and how to read it without DeepSpeed) is moe_lm/checkpoint/format.py. A kill at any
moment leaves `latest` naming a complete checkpoint (or nothing): the pointer is replaced with os.replace only
after all ranks finished writing and the COMPLETE marker (every file's size and hash) is down, and older
checkpoints are pruned only after that. A model whose weights are not finite is never saved.

A save writes into an empty folder of its own: rank 0 creates it with SAVING in it (removed once COMPLETE is
down) before any rank writes. A leftover of an interrupted save of ours (SAVING, no COMPLETE, nothing but a save's
files) is removed first; any other folder of that name (the user's, or a complete checkpoint a resume went back
past) is moved aside to `<tag>.prev-<time>`, never deleted. So COMPLETE lists exactly what this save wrote, and
rotation removes only complete checkpoints (every file one COMPLETE lists, or a save's text files) and interrupted
saves: a `step_*` folder without COMPLETE or SAVING is the user's and stays.

DeepSpeed itself loads its files with `torch.load(weights_only=False)`, which runs whatever code a pickle carries.
So DeepSpeed's load runs with every torch.load forced weights-only (`weights_only_everywhere`), allowing the few
DeepSpeed classes its optimizer-state files hold (`deepspeed_classes`); and before that, every .pt file must pass
a weights-only load of our own (`verify_safe`), which names a refused file. The RNG state is saved as tensors and
numbers.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from moe_lm.checkpoint.format import (
    COMPLETE,
    MODEL_FILE,
    TAG,
    ckpt_root,
    complete_record,
    complete_tags,
    damage,
    data_reference,
    latest_tag,
    load_model,
    safe_load,
    saved_world_size,
)
from moe_lm.compat import old_form
from moe_lm.config import Config, config_to_dict, dump_config, load_config
from moe_lm.errors import RunError
from moe_lm.files import disk_full, gib
from moe_lm.model import Transformer, build_model
from moe_lm.output_folder import moved_aside
from moe_lm.parallel.engine import Engine

# Sections whose change makes an existing checkpoint a different experiment (the rest may change on resume).
RESUME_MUST_MATCH = ("model", "data")
SAVING = "SAVING"  # in a checkpoint folder while it is being written (its writer's pid and host)
CHECKPOINT_TEXT_FILES = (COMPLETE, "config.yaml", "data_ref.json", SAVING)  # what a save writes beside the .pt files


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def everywhere(ok: bool) -> bool:
    """True only if `ok` holds on every rank (so that all ranks take the same branch)."""
    if not dist.is_initialized():
        return ok
    # why the device: NCCL reduces device tensors only ("No backend type associated with device type cpu", the
    # first GPU run); gloo reduces CPU ones
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def weights_finite(model: torch.nn.Module) -> bool:
    """Every parameter and buffer finite, on every rank (expert shards differ between ranks; the layers of other
    pipeline stages are on the meta device here, and left out)."""
    tensors = [*model.parameters(), *(b for b in model.buffers() if b.is_floating_point())]
    tensors = [t for t in tensors if not t.is_meta]
    return everywhere(all(bool(t.isfinite().all()) for t in tensors))


def save(
    engine: Engine, run_dir: Path, step: int, cfg: Config, client_state: dict, keep_last: int, data_ref: dict, log
) -> str:
    """Save on every rank into a folder of its own; rank 0 then marks it complete, moves the pointer, and prunes
    old checkpoints. `data_ref`: the data the run read at its start (`data_reference`), recorded as it was then.

    The caller checks the model is healthy first (`weights_finite`). A failed write (a full disk, say) removes
    this checkpoint's own folder and raises, naming the checkpoint that is still good.
    """
    root = ckpt_root(run_dir)
    tag = f"step_{step:08d}"
    failed = None
    if rank() == 0:
        try:
            _fresh_folder(root / tag, log)
        except OSError as e:
            failed = e
    if not everywhere(failed is None):  # why agreed first: no rank may write into a folder that is not ours
        raise RunError(f"could not start checkpoint {root / tag} ({_why(failed, root)}); the last good checkpoint, "
                       f"{latest_tag(run_dir) or 'none'}, is intact")  # fmt: skip
    try:
        engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
        torch.save(_rng_state(), root / tag / f"rng_rank{rank()}.pt")
    except (OSError, RuntimeError) as e:  # why RuntimeError: torch's zip writer reports a full disk as one
        failed = e
    if everywhere(failed is None) and rank() == 0:
        try:
            dump_config(cfg, root / tag / "config.yaml")
            (root / tag / "data_ref.json").write_text(json.dumps(data_ref))
            # the binary state files; config.yaml and data_ref.json stay editable text
            _write_synced(root / tag / COMPLETE, json.dumps(complete_record(root / tag)))
            (root / tag / SAVING).unlink()
            _write_synced(root / "latest.tmp", tag)
            os.replace(root / "latest.tmp", root / "latest")
        except OSError as e:
            failed = e
    if not everywhere(failed is None):
        if rank() == 0:  # this save's own, incomplete folder; `latest` still names the previous checkpoint
            shutil.rmtree(root / tag, ignore_errors=True)
            (root / "latest.tmp").unlink(missing_ok=True)
        raise RunError(
            f"could not write checkpoint {root / tag} ({_why(failed, root)}); it was removed, and the last good "
            f"checkpoint, {latest_tag(run_dir) or 'none'}, is intact. Free disk space, then run the same command to "
            "resume"
        ) from failed
    if rank() == 0:
        _prune(root, keep_last, tag)
    barrier()
    return tag


def _why(failed: BaseException | None, root: Path) -> str:
    if failed is None:
        return "another rank failed to write"
    if disk_full(failed):
        return f"the disk is full: {gib(shutil.disk_usage(root).free)} free"
    return f"{type(failed).__name__}: {failed}"


def resume(engine: Engine, cfg: Config, run_dir: Path, log) -> dict:
    """Restore the run's latest loadable checkpoint into `engine`; returns the state the loop saved with it (step,
    samples consumed, training seconds), or step and samples 0 for a new run.

    A damaged checkpoint (a file missing, truncated, or failing to load) is named and the previous complete one
    is used instead. A run folder with a history but no loadable checkpoint is refused, never restarted over.
    The checkpoint must belong to the same experiment (RESUME_MUST_MATCH) and data (the tokenizer's hash).
    Saved at another ep_size or world size, its weights load with a fresh optimizer state (DeepSpeed cannot
    re-shard it).
    `log` prints on rank 0.
    """
    newest = latest_tag(run_dir, warn=log)
    if newest is None:
        _refuse_restart_over_history(run_dir)
        return {"step": 0, "samples": 0, "train_seconds": 0.0}
    saved = load_config(ckpt_root(run_dir) / newest / "config.yaml")
    _check_same_experiment(saved, cfg, run_dir, ckpt_root(run_dir) / newest)
    # why weights only on a change: ZeRO's optimizer state is partitioned over the ranks (and expert state over the
    # expert-data-parallel groups); DeepSpeed cannot re-shard it and refuses another world size outright
    saved_world = saved_world_size(ckpt_root(run_dir) / newest)
    world = dist.get_world_size() if dist.is_initialized() else 1
    same_layout = _same_layout(saved, cfg, saved_world, world)
    if not same_layout:
        log(
            f"warning: {newest} was saved by {saved_world} ranks at parallel.ep_size={saved.parallel.ep_size}; "
            f"loading its weights into {world} ranks at ep_size={cfg.parallel.ep_size} with a fresh optimizer state "
            "(DeepSpeed cannot re-shard it)"
        )
    candidates = [t for t in reversed(complete_tags(run_dir)) if t <= newest]
    for tag in candidates:
        problem = damage(ckpt_root(run_dir) / tag)
        if everywhere(problem is None):
            try:
                state = load(engine, run_dir, tag, load_optimizer_states=same_layout)
            except Exception as e:  # a corrupt file surfaces as several exception types
                problem = f"loading {ckpt_root(run_dir) / tag} failed ({type(e).__name__}: {e})"
            if everywhere(problem is None):
                log(f"resumed from {ckpt_root(run_dir) / tag} at step {state['step']}")
                return state
        log(f"warning: checkpoint {tag} is damaged: {problem or 'on another rank'}; trying the one before it")
    raise RunError(
        f"no checkpoint in {ckpt_root(run_dir)} loads ({', '.join(candidates)} are damaged). Start afresh with "
        "train.resume=false (the run folder is moved aside, not deleted)"
    )


def _same_layout(saved: Config, cfg: Config, saved_world: int, world: int) -> bool:
    p, q = saved.parallel, cfg.parallel
    return p.ep_size == q.ep_size and p.pp_size == q.pp_size and saved_world == world


class Restart(NamedTuple):
    model: Transformer  # the checkpoint's weights in a plain model, to be cut and sharded like a new one
    state: dict  # what the loop saved with it (step, samples, train_seconds)


def resume_across_stages(cfg: Config, run_dir: Path, log) -> Restart | None:
    """The run's newest checkpoint when it was saved with pipeline stages at another layout than `cfg`'s, or is
    resumed into one (pp_size, ep_size or world size changed, stages on either side); None otherwise (`resume`
    restores it through DeepSpeed).

    why our own reader: DeepSpeed's pipeline files number layers and experts by stage; they do not load into a
    model cut otherwise, or not cut at all. The weights come through `load_model` (any layout gives the plain
    model), the optimizer state starts afresh (as at any layout change), and the step and sample counters continue.
    """
    newest = latest_tag(run_dir, warn=log)
    if newest is None:
        return None
    folder = ckpt_root(run_dir) / newest
    saved = load_config(folder / "config.yaml")
    world = dist.get_world_size() if dist.is_initialized() else 1
    saved_world = saved_world_size(folder)
    if (saved.parallel.pp_size == 1 and cfg.parallel.pp_size == 1) or _same_layout(saved, cfg, saved_world, world):
        return None
    _check_same_experiment(saved, cfg, run_dir, folder)
    _, plain, tag = load_model(run_dir, newest)
    model = build_model(cfg.model)  # why anew: load_model builds for CPU tools (its expert backend may differ)
    model.load_state_dict(plain.state_dict())
    client = safe_load(folder / MODEL_FILE, mmap=True)  # stage 0's file holds the loop's state with pipelines too
    state = {k: client[k] for k in ("step", "samples", "train_seconds") if k in client}
    log(
        f"warning: {tag} was saved by {saved_world} ranks at parallel.pp_size={saved.parallel.pp_size}, "
        f"ep_size={saved.parallel.ep_size}; loading its weights into {world} ranks at pp_size={cfg.parallel.pp_size}, "
        f"ep_size={cfg.parallel.ep_size} with a fresh optimizer state (DeepSpeed cannot re-shard it); resumed from "
        f"{folder} at step {state['step']}"
    )
    return Restart(model, state)


def _check_same_experiment(saved: Config, cfg: Config, run_dir: Path, folder: Path) -> None:
    changed = [s for s in RESUME_MUST_MATCH if config_to_dict(saved)[s] != config_to_dict(cfg)[s]]
    if changed:
        raise RunError(
            f"{run_dir} holds a run with different {' and '.join(changed)} settings; resume it with its own config "
            f"({run_dir / 'config.yaml'}), pick another train.out_dir, or pass train.resume=false to start afresh"
        )
    ref_file = folder / "data_ref.json"
    trained_with = json.loads(ref_file.read_text()).get("tokenizer_sha256") if ref_file.is_file() else None
    now = data_reference(cfg)["tokenizer_sha256"]
    if trained_with and now and trained_with != now:
        raise RunError(
            f"the tokenizer in {cfg.data.out_dir} is not the one {folder} was trained with (the data was prepared "
            "again); the token ids would mean other words. Resume on the original data (prepare it "
            "again with the run's config.yaml into its own data.out_dir), or start afresh with train.resume=false"
        )


def _refuse_restart_over_history(run_dir: Path) -> None:
    """A folder with checkpoint folders or logged steps but nothing to resume from is not a new run."""
    metrics = run_dir / "metrics.jsonl"
    steps = sorted(p.name for p in ckpt_root(run_dir).glob("step_*")) if ckpt_root(run_dir).is_dir() else []
    if steps or (metrics.is_file() and metrics.stat().st_size > 0):
        what = f"checkpoint folders without a complete one ({', '.join(steps)})" if steps else f"a log ({metrics})"
        raise RunError(
            f"{run_dir} holds a run ({what}) but no complete checkpoint to resume from; starting over would "
            "overwrite it. Pass train.resume=false to start afresh (the folder is moved aside), or pick another "
            "train.out_dir"
        )


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def deepspeed_classes() -> list:
    """What DeepSpeed's ZeRO-1/2 optimizer-state files hold beyond tensors, numbers, strings and containers (found
    with torch.serialization.get_unsafe_globals_in_checkpoint on the files it writes): plain records whose
    unpickling sets attributes and runs no code of the file's choosing."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler  # the (unused in fp32/bf16) loss-scale state
    from deepspeed.runtime.zero.config import ZeroStageEnum  # an int enum: the stage the file was saved at
    from deepspeed.utils.tensor_fragment import fragment_address  # a dataclass: (numel, start) of a fragment

    return [LossScaler, ZeroStageEnum, fragment_address]


def legacy_rng_classes() -> list:
    """RNG files written before they held tensors only: numpy's state as an array (rebuilt, no code run)."""
    reconstruct = (np._core if hasattr(np, "_core") else np.core).multiarray._reconstruct  # numpy 2 renamed np.core
    # why both names: a pickle names the function as the numpy that wrote it spelled it (numpy 1: numpy.core,
    # numpy 2: numpy._core), and pyproject allows either
    spelled = [(reconstruct, f"numpy.{core}.multiarray._reconstruct") for core in ("core", "_core")]
    return [*spelled, np.ndarray, np.dtype, type(np.dtype(np.uint32))]  # the last: the key array's dtype class


def verify_safe(folder: Path) -> None:
    """Every .pt file of a checkpoint passes a weights-only load (memory-mapped: the tensors are not read); raises
    UnsafeCheckpoint naming the file otherwise, before DeepSpeed has loaded anything of the checkpoint."""
    allowed = deepspeed_classes() + legacy_rng_classes()
    for path in sorted(folder.glob("*.pt")):
        safe_load(path, allowed, mmap=True)


FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch/serialization.py reads it at every torch.load


@contextlib.contextmanager
def weights_only_everywhere(allowed: list):
    """Within the block every torch.load is weights-only with `allowed` classes, whatever its caller passes."""
    # why the variable, not a checkpoint engine of our own: swapping engine.checkpoint_engine reaches into
    # DeepSpeed's internals and misses its other loads (torch.load called directly for universal checkpoints in
    # runtime/base_optimizer.py; load_moe_state_dict defaults to a fresh TorchCheckpointEngine). torch reads the
    # variable at each call and it overrides weights_only=False, so the guarantee holds at the read itself, also
    # if a file were replaced after verify_safe read it.
    before = os.environ.get(FORCE_WEIGHTS_ONLY)
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(allowed):
            yield
    finally:
        if before is None:
            os.environ.pop(FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[FORCE_WEIGHTS_ONLY] = before


def load(engine: Engine, run_dir: Path, tag: str, load_optimizer_states: bool = True) -> dict:
    """Restore engine state and this rank's RNG from checkpoint `tag`; returns the client state."""
    root = ckpt_root(run_dir)
    verify_safe(root / tag)  # why first: it names a refused file, and DeepSpeed has not half-loaded anything yet
    with weights_only_everywhere(deepspeed_classes()):
        path, client_state = engine.load_checkpoint(
            str(root), tag=tag, load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=False
        )
    if path is None:
        raise RunError(f"DeepSpeed could not load checkpoint {root / tag}")
    rng_file = root / tag / f"rng_rank{rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(safe_load(rng_file, legacy_rng_classes()), rng_file)
    return client_state


def _fresh_folder(folder: Path, log) -> None:
    """Make `folder` an empty checkpoint folder of this save, holding SAVING: an interrupted save's leftover there
    is removed, anything else moved aside (`<tag>.prev-<time>`) and said."""
    if folder.is_symlink() or folder.exists():
        if interrupted_save(folder):
            shutil.rmtree(folder)
        else:
            aside = moved_aside(folder)
            log(f"warning: {folder} existed (not a save in progress); moved it to {aside}, nothing deleted")
    folder.mkdir(parents=True)
    (folder / SAVING).write_text(f"pid {os.getpid()} on {os.uname().nodename}\n")


def interrupted_save(folder: Path) -> bool:
    """A save of ours that stopped before COMPLETE: SAVING in it, no COMPLETE, nothing but a save's files."""
    return (
        folder.is_dir()
        and not folder.is_symlink()
        and (folder / SAVING).is_file()
        and not (folder / COMPLETE).exists()
        and only_checkpoint_files(folder)
    )


def _prune(root: Path, keep_last: int, current: str) -> None:
    """Remove the complete checkpoints older than the newest `keep_last`, and the leftovers of interrupted saves:
    only folders named as moe-lm names them (`step_` + 8 digits) that hold nothing but what a save writes. A folder
    without COMPLETE or SAVING is not a save of ours, and stays."""
    tags = sorted(p for p in root.iterdir() if TAG.fullmatch(p.name) and p.is_dir() and not p.is_symlink())
    complete = [p for p in tags if (p / COMPLETE).is_file()]
    keep = {p.name for p in complete[-keep_last:]} | {current}
    for p in tags:
        if p.name in keep or p.name >= current:
            continue
        if ((p / COMPLETE).is_file() and only_checkpoint_files(p)) or interrupted_save(p):
            shutil.rmtree(p, ignore_errors=True)


def only_checkpoint_files(folder: Path) -> bool:
    """Whether `folder` holds only what a save writes: the state files (those COMPLETE lists, when it exists),
    config.yaml, data_ref.json, COMPLETE and SAVING. Anything else is the user's, and keeps the folder from
    rotation."""
    try:
        listed = set(json.loads((folder / COMPLETE).read_text())) if (folder / COMPLETE).is_file() else None
    except (OSError, ValueError, TypeError):
        return False
    for entry in folder.iterdir():
        if entry.is_symlink() or not entry.is_file():
            return False
        if entry.name in CHECKPOINT_TEXT_FILES:
            continue
        if not entry.name.endswith(".pt") or (listed is not None and entry.name not in listed):
            return False
    return True


def _rng_state() -> dict:
    """This process's RNG states as tensors and plain numbers (a weights-only load reads them back)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, mt, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss_next": gauss_next},
    }  # fmt: skip
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict, source: Path) -> None:
    torch.set_rng_state(state["torch"])
    numpy, python = state["numpy"], state["python"]
    if isinstance(numpy, dict):
        keys = numpy["keys"].numpy().astype(np.uint32)
        np.random.set_state((numpy["name"], keys, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"]))
        random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss_next"]))
    else:  # a checkpoint written before the RNG state was tensors: numpy's tuple and python's as they were
        old_form(f"{source} (numpy arrays)", "resume the run once with moe-lm 0.2, which saves tensors")
        np.random.set_state(numpy)
        random.setstate(python)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
