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
import time
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
        raise ConfigError(f"no confirmatory declaration for {name} ({path}); declared: {known}")
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


def declare(exp: Experiment, definition: Path, pilot: dict, steps: int, schedule: str, first_seed: int = 100) -> str:
    """The declaration (YAML) of `exp`'s confirmatory round, sized from its pilot report (`pilot`: results.json):
    as many seeds as the reachable judged comparisons need (`power.seeds_needed`), at `steps`, seeds from
    `first_seed`. `schedule` says why these steps (the schedule study)."""
    from moe_lm.experiments.power import TARGET, seeds_needed

    sizing, needs = {}, []
    for c in pilot["comparisons"]:
        if c["role"] == "context" or len(c.get("deltas", [])) < 2:
            continue
        p = seeds_needed(c["deltas"], c["expect"], c["margin"])
        sizing[c["name"]] = {"pilot_seeds": p.pilot_seeds, "pilot_steps": pilot["steps"], "mean": round(p.mean, 5),
                             "sd": round(p.sd, 5), "seeds_needed": p.seeds, "p_supported": round(p.p_supported, 3),
                             "p_contradicted": round(p.p_contradicted, 3)}  # fmt: skip
        if p.seeds:
            needs.append(p.seeds)
    if not needs:
        raise ConfigError(f"{exp.name}: no judged comparison reaches a verdict with {TARGET:.0%} probability in "
                          "any design the power analysis considers; nothing to declare")  # fmt: skip
    record = {
        "experiment": exp.name, "definition_sha256": definition_hash(definition), "arms": list(exp.arms),
        "comparisons": [dataclasses.asdict(c) for c in exp.comparisons], "first_seed": max(first_seed, exp.seeds),
        "seeds": max(needs), "steps": steps, "schedule": schedule, "power": sizing,
        "declared": time.strftime("%Y-%m-%d"),
    }  # fmt: skip
    head = (f"# Confirmatory round of `{exp.name}`, declared before its first run (docs/experiments.md §6): the "
            "definition's arms,\n# comparisons, margins and rule unchanged; fresh seeds; sized from the pilot "
            "(moe-lm experiment --power).\n")  # fmt: skip
    return head + yaml.safe_dump(record, sort_keys=False, allow_unicode=True, width=118)
