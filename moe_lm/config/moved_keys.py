"""Keys that moved when the training section was split (old spelling -> new): configs, experiment definitions and
run folders written before keep loading, each old spelling noted once per process, until the release MOVED_UNTIL;
from then on an old spelling is an error that names the new one."""

from __future__ import annotations

import os
import sys
from typing import Any

from moe_lm.compat import release
from moe_lm.errors import ConfigError

MOVED = {
    **{f"train.{k}": f"cadence.{k}" for k in ("log_interval", "eval_interval", "eval_batches", "ckpt_interval")},
    "train.keep_last": "cadence.keep_last",
    "train.objective": "objective.name",
    "train.prefix_len": "objective.prefix_len",
    "train.mlm_prob": "objective.mlm_prob",
    "logging.wandb_console": "logging.verbose",
    **{f"train.{k}": f"performance.{k}" for k in ("activation_checkpointing", "compile", "loss_chunk")},
}
MOVED_UNTIL = (0, 3)  # from moe-lm 0.3 on, an old spelling is an error that names the new one
_noted: set[str] = set()


def new_spelling(key: str, where: str) -> str:
    new = MOVED.get(key)
    if new is None:
        return key
    if release() >= MOVED_UNTIL:
        until = ".".join(map(str, MOVED_UNTIL))
        raise ConfigError(
            f"{where}: {key} was renamed {new}, and moe-lm {until} no longer reads the old key: write {new}"
        )
    if key not in _noted and os.environ.get("RANK", "0") == "0":
        _noted.add(key)
        print(f"note: {key} is now {new} ({where}; the old key still works: rename it)", file=sys.stderr)
    return new


def moved_keys(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """`raw` (one file's sections) with the old spellings of MOVED keys put where they live now."""
    raw = dict(raw)
    for old in MOVED:
        section, key = old.split(".")
        if not isinstance(raw.get(section), dict) or key not in raw[section]:
            continue
        new_section, new_key = new_spelling(old, where).split(".")
        raw[section] = dict(raw[section])
        target = raw.setdefault(new_section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{where}: '{new_section}' must be a mapping of keys")
        if new_key in target:
            raise ConfigError(f"{where}: both {old} and {new_section}.{new_key} are set; keep {new_section}.{new_key}")
        raw[new_section] = {**target, new_key: raw[section].pop(key)}
    return raw
