"""A run's checkpoints on disk, read without DeepSpeed: the layout, DeepSpeed's file names, the expert-key mapping.

    <run>/checkpoints/step_00000200/    DeepSpeed's files, config.yaml, data_ref.json, rng_rank<r>.pt, and
                                        COMPLETE (written last: each .pt file's size and xxh3-128 hash, as JSON)
    <run>/checkpoints/latest            the tag of the newest COMPLETE checkpoint

Run folders travel, so no file of one is trusted to be what it claims: every .pt file is read with
`torch.load(weights_only=True)` (`safe_load`), which rebuilds tensors and plain containers and refuses any other
object instead of running the code a pickle can carry. The hashes catch bit rot and truncation; they are no defence
against someone who edits COMPLETE as well, which is what the safe load is for.

DeepSpeed writes the non-expert weights to `mp_rank_00_model_states.pt` and each *global* expert to
`layer_<l>_expert_<e>_mp_rank_00_model_states.pt`, under keys `<moe>.deepspeed_moe.experts.deepspeed_experts.<e>.
<param>` (docs/deepspeed.md §4). Our experts are stacked [E, ...]; `per_expert_keys` / `stacked_keys` convert
between the two, for the expert-parallel shell (moe_lm/parallel/expert_parallel.py) and for `load_model` here,
which gives generation, export and analytics the plain model on CPU. This module never imports deepspeed.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch

from moe_lm.compat import old_form
from moe_lm.config import Config, load_config
from moe_lm.data.tokenizer import data_tokenizer_sha256
from moe_lm.deepspeed_layout import model_keys, plain_state_dict
from moe_lm.errors import DataError, NotFound
from moe_lm.files import HASH, file_hash, read_small
from moe_lm.model import Transformer, build_model

COMPLETE = "COMPLETE"
TAG = re.compile(r"step_\d{8}")  # a checkpoint's folder name, as save writes it: step_ + the step in 8 digits
MODEL_FILE = "mp_rank_00_model_states.pt"
EXPERT_FILES = "layer_*_expert_*_mp_rank_00_model_states.pt"
# with pipeline stages (parallel.pp_size > 1) each stage s writes mp_rank_<s> files: its non-expert weights, and its
# experts numbered by the stage's own MoE layers (layer_0 is each stage's first); see `model_keys`
STAGE_MODEL_FILES = "mp_rank_*_model_states.pt"
STAGE_EXPERT_FILES = "layer_*_expert_*_mp_rank_*_model_states.pt"
# one per data-parallel rank and pipeline stage (bf16_ prefix in bf16)
ZERO_FILES = "*zero_pp_rank_*_mp_rank_*_optim_states.pt"


def ckpt_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_tag(run_dir: Path, warn=None) -> str | None:
    """The tag `latest` names, or None when the run has no complete checkpoint. When the pointer is missing,
    unreadable or names an incomplete checkpoint, the newest complete one (`warn` says so)."""
    complete = complete_tags(run_dir)
    pointer = ckpt_root(run_dir) / "latest"
    text = read_small(pointer)  # why not read_text: a FIFO put there would block every reader
    tag = text.strip() if text is not None else None
    if tag in complete or not complete:
        return tag if tag in complete else None
    why = "is missing or unreadable" if tag is None else f"names {tag!r}, which is not a complete checkpoint"
    if warn is not None:
        warn(f"warning: {pointer} {why}; using the newest complete checkpoint, {complete[-1]}")
    return complete[-1]


def complete_record(folder: Path) -> dict:
    """What COMPLETE records of a checkpoint's binary state files: {name: {"bytes": size, "xxh3_128": hash}}."""
    return {p.name: {"bytes": p.stat().st_size, HASH: file_hash(p)} for p in sorted(folder.glob("*.pt"))}


def damage(folder: Path, names: Iterable[str] | None = None) -> str | None:
    """What is wrong with a complete checkpoint's state files (missing, of another size or content than written),
    or None. `names`: only these files (default: all that COMPLETE lists). COMPLETE files from before the hashes
    (sizes only) are checked on sizes."""
    try:
        record = json.loads((folder / COMPLETE).read_text() or "{}")
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return f"{folder / COMPLETE} is unreadable"
    wanted = set(record) if names is None else set(names) & set(record)
    for name in sorted(wanted):
        if not isinstance(record[name], dict):  # sizes only: before the hashes
            old_form(f"{folder / COMPLETE} (sizes without hashes)", "resume the run once with moe-lm 0.2 to save again")
        entry = record[name] if isinstance(record[name], dict) else {"bytes": record[name]}
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, {entry['bytes']} were written (truncated or corrupt)"
        if HASH in entry and file_hash(path) != entry[HASH]:
            return f"{path} is not the file that was written (its content hash differs: altered or bit-rotted)"
    return None


class UnsafeCheckpoint(DataError):
    """A checkpoint file holds objects a weights-only load refuses (a pickle can run code): nothing of it was run."""


def safe_load(path: Path, allowed: Iterable = (), mmap: bool = False):
    """`torch.load(path, weights_only=True)` on the CPU, with `allowed` classes beside tensors and containers.
    A file holding anything else is refused, naming the file and the object, before any of it is run."""
    with open(path, "rb") as f:
        mmap = mmap and torch.serialization._is_zipfile(f)  # why: only the zip format maps; garbage must still fail
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)|but got <class '([\w.]+)'>", str(e))  # torch names what it refused
        what = f"an object of {found.group(1) or found.group(2)}" if found else "objects other than tensors"
        raise UnsafeCheckpoint(
            f"{path} holds {what}, which a weights-only load refuses: it was not loaded and nothing in it ran. "
            "If it comes from someone else, do not trust it; if it is your own, it was written by another program "
            "than moe-lm's training"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:  # torch's errors for a truncated or garbled file
        raise DataError(f"{path} does not load ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


def saved_world_size(folder: Path) -> int:
    """The number of ranks a checkpoint was saved by: DeepSpeed writes one ZeRO optimizer-state file per rank (per
    data-parallel rank of each pipeline stage)."""
    return len(list(Path(folder).glob(ZERO_FILES)))


def complete_tags(run_dir: Path) -> list[str]:
    """Tags of the run's complete checkpoints, oldest first."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.glob("step_*") if TAG.fullmatch(p.name) and (p / COMPLETE).is_file())


# ------------------------------------------------------------------------------------------ RUN[:TAG]


class RunRef(NamedTuple):
    run: Path
    tag: str | None  # None: the latest complete checkpoint


def parse_run(spec: str) -> RunRef:
    """`RUN` or `RUN:TAG` (e.g. runs/tiny:step_00000500), as every launch script takes a checkpoint."""
    run, _, tag = spec.partition(":")
    return RunRef(Path(run), tag or None)


# ---------------------------------------------------------------------------------------- the data


def data_reference(cfg: Config) -> dict:
    """Where the run's data and tokenizer are (absolute), and the tokenizer's hash: saved with each checkpoint."""
    data_dir = Path(cfg.data.out_dir).resolve()
    return {"data_dir": str(data_dir), "tokenizer_sha256": data_tokenizer_sha256(data_dir)}


def resolve_data(cfg: Config, folder: Path) -> Config:
    """The checkpoint's config with data.out_dir pointing at the data it was trained on, wherever we run from."""
    ref_file = folder / "data_ref.json"
    if not ref_file.is_file():
        return cfg
    ref = json.loads(ref_file.read_text())
    now = data_tokenizer_sha256(ref["data_dir"])
    if ref["tokenizer_sha256"] and now and now != ref["tokenizer_sha256"]:
        raise DataError(
            f"the tokenizer in {ref['data_dir']} (tokenizer.model or tokenizer/) is not the one this checkpoint was "
            "trained with (the data was prepared again, or the file was edited or damaged); restore it from a copy "
            "(an export of this run holds one) or prepare the data again with the run's config.yaml"
        )
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, out_dir=ref["data_dir"]))


# ------------------------------------------------------------------------------------------- loading


def checkpoint_folder(run_dir: str | Path, tag: str | None = None) -> Path:
    """The folder of a run's complete checkpoint `tag` (the latest complete one by default); FileNotFoundError
    naming the complete ones otherwise."""
    run_dir = Path(run_dir)
    tag = tag or latest_tag(run_dir, warn=lambda message: print(message, file=sys.stderr))
    if tag is None:
        raise NotFound(f"no complete checkpoint in {ckpt_root(run_dir)} (train first, or check the path)")
    folder = ckpt_root(run_dir) / tag
    if not (folder / COMPLETE).is_file():
        raise NotFound(
            f"{folder} is not a complete checkpoint; complete ones in {ckpt_root(run_dir)}: "
            f"{', '.join(complete_tags(run_dir)) or 'none'}"
        )
    return folder


ROTATION_RETRIES = 2  # reads of the newest checkpoint after the one being read was rotated away


def load_model(run_dir: str | Path, tag: str | None = None) -> tuple[Config, Transformer, str]:
    """(config, Transformer in eval mode, tag) from a run's checkpoint (the latest complete one by default), on CPU,
    without DeepSpeed: for generation, analytics and export. Checkpoints of any ep_size give the same model.
    A checkpoint that a running training rotates away (cadence.keep_last) while it is read is replaced by the newest
    one when no tag was asked for, and named in the error otherwise."""
    run_dir = Path(run_dir)
    retries = ROTATION_RETRIES
    while True:
        folder, files = checkpoint_folder(run_dir, tag), []
        try:
            files = [p.name for p in folder.iterdir()]
            return _load_folder(run_dir, folder)
        except (OSError, ValueError, KeyError):
            # why this test: a complete checkpoint's files are only ever removed by the rotation, a folder at a time
            if (folder / COMPLETE).is_file() and all((folder / name).exists() for name in files):
                raise  # not a rotation: the error names what is wrong
        why = f"checkpoint {folder} was rotated away by the running training (cadence.keep_last) while it was read"
        # why not with a tag: RUN:TAG asked for that checkpoint, not for whichever is the newest
        if tag is not None or not retries:
            raise NotFound(f"{why}; complete ones now: {', '.join(complete_tags(run_dir)) or 'none'}")
        retries -= 1
        print(f"note: {why}; reading the newest one", file=sys.stderr)


def _load_folder(run_dir: Path, folder: Path) -> tuple[Config, Transformer, str]:
    tag = folder.name
    cfg = resolve_data(load_config(folder / "config.yaml"), folder)
    staged = cfg.parallel.pp_size > 1
    model_files = sorted(folder.glob(STAGE_MODEL_FILES)) if staged else [folder / MODEL_FILE]
    expert_files = sorted(folder.glob(STAGE_EXPERT_FILES if staged else EXPERT_FILES))
    if problem := damage(folder, [f.name for f in model_files + expert_files]):
        raise DataError(f"checkpoint {folder} is damaged: {problem}; use an earlier one ({_others(run_dir, tag)})")
    # DeepSpeed's model files hold tensors, containers and strings only: no allowlist needed
    state = {}
    for model_file in model_files:
        state.update(_module_state(safe_load(model_file), model_file))
    for expert_file in expert_files:
        state.update(safe_load(expert_file))
    if cfg.model.moe.experts_impl == "megablocks":
        # why: offline tools run on CPU, and the weights do not depend on the expert backend
        cfg.model.moe.experts_impl = "grouped"
    model = build_model(cfg.model)
    try:
        if staged:
            state = model_keys(state, cfg.model.n_layers)
        model.load_state_dict({k: v.float() for k, v in plain_state_dict(state, model.state_dict()).items()})
    except (KeyError, RuntimeError) as e:  # a missing or unexpected key, a size mismatch
        detail = str(e.args[0] if isinstance(e, KeyError) and e.args else e).strip().splitlines()
        raise DataError(
            f"{folder / 'config.yaml'} does not describe the weights saved beside it ({' '.join(detail[:2])[:300]}): "
            "it was edited (its model section must stay as trained); restore it, e.g. from the run's config.yaml"
        ) from None
    bad = [name for name, p in model.named_parameters() if not p.isfinite().all()]
    if bad:
        raise DataError(
            f"checkpoint {folder} holds non-finite weights ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}): "
            f"the run diverged; use an earlier checkpoint ({_others(run_dir, tag)})"
        )
    return cfg, model.eval(), tag


def _module_state(saved, path: Path) -> dict:
    if not isinstance(saved, dict) or not isinstance(saved.get("module"), dict):
        raise DataError(f"{path} is not a DeepSpeed model-state file (no 'module' state dict in it)")
    return saved["module"]


def _others(run_dir: Path, tag: str) -> str:
    others = [t for t in complete_tags(run_dir) if t != tag]
    return ", ".join(f"{run_dir}:{t}" for t in others) if others else "there is none"
