"""A confirmatory round, declared before it runs: fresh seeds, a schedule and the power estimate that sized them,
for an experiment whose definition (arms, comparisons, margins, verdict rule) stays as it was.

    configs/experiments/confirmatory/mtp.yaml
        experiment: mtp
        definition_sha256: ...     the definition file as declared (configs/experiments/mtp.yaml)
        arms: [d0, d1]             the arms, as in the definition
        comparisons: [...]         its comparisons (the rule and margins), copied: what will be judged
        first_seed: 100            seeds first_seed .. first_seed + seeds - 1: none of them the pilot's
        seeds: 6
        steps: 360
        schedule: why these steps  (the schedule study)
        power: {...}               per judged comparison: the pilot it was sized from and the seeds it needs

`moe-lm experiment mtp --confirm` runs exactly that and judges it, the report saying "confirmatory" and naming the
declaration; the pilot's runs are not pooled (other seeds, other run folders). A definition changed since the
declaration (its hash), an arm or comparison that differs from the copy, or other seeds or steps on the command line
are refused: a confirmatory verdict is given only to the declared design.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

import yaml

from moe_lm.config import ConfigError, safe_yaml, yaml_problem
from moe_lm.experiments.spec import EXPERIMENTS_DIR, Experiment

DECLARATIONS_DIR = EXPERIMENTS_DIR / "confirmatory"
FIELDS = ("experiment", "definition_sha256", "arms", "comparisons", "first_seed", "seeds", "steps", "schedule",
          "power", "declared")  # fmt: skip


@dataclass(frozen=True)
class Declaration:
    path: Path
    experiment: str
    definition_sha256: str
    arms: list[str]
    comparisons: list[dict]
    first_seed: int
    seeds: int
    steps: int
    schedule: str
    power: dict
    declared: str


def definition_hash(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_declaration(name: str) -> Declaration:
    """The declaration of experiment `name` (configs/experiments/confirmatory/NAME.yaml), or a ConfigError."""
    path = DECLARATIONS_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in DECLARATIONS_DIR.glob("*.yaml"))) or "none"
        raise ConfigError(f"--confirm: no declaration for {name} ({path}); declared: {known}")
    try:
        raw = safe_yaml(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML, {yaml_problem(e)}") from None
    missing, unknown = set(FIELDS) - set(raw), set(raw) - set(FIELDS)
    if missing or unknown:
        raise ConfigError(f"{path}: missing {sorted(missing)}, unknown {sorted(unknown)} (fields: {list(FIELDS)})")
    return Declaration(path=path, **{k: raw[k] for k in FIELDS})


def confirmatory(exp: Experiment, definition: Path, d: Declaration) -> Experiment:
    """`exp` as its declaration has it (seeds, steps), after checking that nothing judged has changed since: the
    definition file's hash, the arms, the comparisons. A ConfigError names what deviates."""
    deviations = []
    if definition_hash(definition) != d.definition_sha256:
        deviations.append(f"{definition} changed since the declaration (its sha256)")
    if list(exp.arms) != list(d.arms):
        deviations.append(f"the arms are {list(exp.arms)}, declared {d.arms}")
    if [dataclasses.asdict(c) for c in exp.comparisons] != d.comparisons:
        deviations.append("the comparisons (rule, margins, roles) differ from the declared ones")
    if d.first_seed < exp.seeds:
        deviations.append(f"seeds from {d.first_seed} overlap the pilot's 0..{exp.seeds - 1}")
    if deviations:
        raise ConfigError(f"{d.path}: no confirmatory verdict: {'; '.join(deviations)}")
    where = d.path.resolve()
    shown = where.relative_to(Path.cwd()) if where.is_relative_to(Path.cwd()) else where  # the checkout's, shorter
    return dataclasses.replace(exp, first_seed=d.first_seed, seeds=d.seeds, steps=d.steps, confirmatory=str(shown))
