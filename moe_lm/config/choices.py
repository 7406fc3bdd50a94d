"""The names some config keys accept beyond the core's (`model.arch`, `model.attn_mask`, `objective.name`), each
with the cross-field rule a config using it must pass. Research variants add theirs when imported
(moe_lm/experiments/variants): the core never imports them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moe_lm.errors import ConfigError, shown

Rule = Callable[[Any], None]  # called with the whole Config (schema.py, which imports this module)

CHOICES: dict[str, dict[str, Rule | None]] = {
    "model.arch": {"decoder": None},
    "model.attn_mask": {"causal": None},
    "objective.name": {"lm": None},
}
VARIANTS_MODULE = "moe_lm.experiments.variants"


def register_choice(key: str, name: str, rule: Rule | None = None) -> None:
    """Let config key `key` (one of CHOICES) accept `name`; `rule(cfg)` raises ConfigError for a config that uses
    it wrongly (naming the key to change)."""
    CHOICES[key][name] = rule


def choices(key: str) -> list[str]:
    """The names `key` accepts now (the core's, and those of every variant imported so far)."""
    return list(CHOICES[key])


def require_choice(key: str, value: str, dotted: str) -> None:
    """A ConfigError naming `dotted` (the key's path) unless `value` is a name `key` accepts now."""
    if value not in CHOICES[key]:
        raise ConfigError(
            f"{dotted} = {shown(value)} is not known; known: {', '.join(CHOICES[key])} (research variants register "
            f"more when {VARIANTS_MODULE} is imported: the moe-lm command and launch/ scripts do)"
        )
