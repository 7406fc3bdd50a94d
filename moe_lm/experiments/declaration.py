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

What makes the file a declaration is that it was fixed before the runs: in a git checkout, its first commit (the
file must be committed, and be as it was in the commit that added it: an edit of the seeds or of a margin with the
hashes rewritten is refused, committed or not); outside one (an installed package), the sha256 that its first
confirmatory run recorded under the runs folder. The report records the declaration's sha256 and its commit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from moe_lm.config import ConfigError, safe_yaml, yaml_problem
from moe_lm.errors import shown
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
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a declaration is a mapping of {list(FIELDS)}, not {shown(raw)}")
    missing, unknown = set(FIELDS) - set(raw), set(raw) - set(FIELDS)
    if missing or unknown:
        raise ConfigError(f"{path}: missing {sorted(missing)}, unknown {sorted(unknown)} (fields: {list(FIELDS)})")
    for key, (kind, ok, want) in TYPES.items():
        value = raw[key]
        if not isinstance(value, kind) or isinstance(value, bool) is not (kind is bool) or not ok(value):
            raise ConfigError(f"{path}: {key} is {shown(value)}; it must be {want}")
    return Declaration(path=path, **{k: raw[k] for k in FIELDS})


# each field's type, what else it must satisfy, and how an error says so
TYPES = {
    "experiment": (str, bool, "the experiment's name"),
    "definition_sha256": (str, lambda v: len(v) == 64 and all(c in "0123456789abcdef" for c in v),
                          "the definition file's sha256 (64 hex digits)"),
    "arms": (list, lambda v: bool(v) and all(isinstance(a, str) for a in v), "a list of the arms' names"),
    "comparisons": (list, lambda v: all(isinstance(c, dict) for c in v), "a list of the comparisons, as defined"),
    "first_seed": (int, lambda v: v >= 0, "a whole number >= 0"),
    "seeds": (int, lambda v: v >= 2, "a whole number >= 2 (a t-interval needs two seeds)"),
    "steps": (int, lambda v: v >= 1, "a whole number >= 1"),
    "schedule": (str, lambda v: True, "text saying why these steps"),
    "power": (dict, lambda v: True, "a mapping: per comparison, the pilot it was sized from"),
    "declared": (str, lambda v: True, "the date it was declared"),
}  # fmt: skip


def provenance(d: Declaration, runs_root: Path) -> dict:
    """{path, sha256, committed_in, checked_against}: what fixes `d` as declared before its runs, after checking that
    it is unchanged since (module docstring); a ConfigError saying what changed and how to restore it otherwise."""
    data = d.path.read_bytes()
    record = {"path": d.path.name, "sha256": hashlib.sha256(data).hexdigest()}
    tracked = _git(d.path.parent, "ls-files", "--error-unmatch", d.path.name)
    in_checkout = _git(d.path.parent, "rev-parse", "--is-inside-work-tree") == "true"
    ignored = in_checkout and _git(d.path.parent, "check-ignore", d.path.name) is not None  # a venv in a checkout
    if in_checkout and not ignored:
        added = (_git(d.path.parent, "log", "--diff-filter=A", "--format=%H", "--", d.path.name) or "").split()
        if tracked is None or not added:
            raise ConfigError(f"{d.path} is not committed: a declaration is fixed by its commit, made before its "
                              "first run; commit it (git add, git commit) and run again")  # fmt: skip
        first = added[-1]  # the oldest commit that added it
        if _git_bytes(d.path.parent, "show", f"{first}:./{d.path.name}") != data:
            raise ConfigError(
                f"{d.path} changed since it was first committed ({first[:10]}): a confirmatory verdict is given to the "
                f"design declared then; restore it (git checkout {first[:10]} -- {d.path.name}, in its folder)"
            )
        return {**record, "committed_in": first, "checked_against": "its first commit"}
    recorded = Path(runs_root) / "declarations" / f"{d.experiment}.sha256"
    if recorded.is_file() and recorded.read_text().strip() != record["sha256"]:
        raise ConfigError(f"{d.path} changed since its first confirmatory run recorded it ({recorded}: sha256 "
                          f"{recorded.read_text().strip()[:16]}...): a confirmatory verdict is given to the design "
                          "declared then; restore the file")  # fmt: skip
    recorded.parent.mkdir(parents=True, exist_ok=True)
    recorded.write_text(record["sha256"] + "\n")
    return {**record, "committed_in": None, "checked_against": f"the sha256 its first run recorded ({recorded})"}


def _git(folder: Path, *args: str) -> str | None:
    out = _git_bytes(folder, *args)
    return None if out is None else out.decode("utf-8", "replace").strip()


def _git_bytes(folder: Path, *args: str) -> bytes | None:
    """git's output in `folder`, or None when git fails or is not installed."""
    try:
        out = subprocess.run(["git", *args], cwd=folder, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def confirmatory(exp: Experiment, definition: Path, d: Declaration, runs_root: Path) -> Experiment:
    """`exp` as its declaration has it (seeds, steps), after checking that nothing judged has changed since: the
    declaration itself (`provenance`), the definition file's hash, the arms, the comparisons. A ConfigError names
    what deviates."""
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
    fixed = provenance(d, runs_root)
    where = d.path.resolve()
    shown = where.relative_to(Path.cwd()) if where.is_relative_to(Path.cwd()) else where  # the checkout's, shorter
    return dataclasses.replace(exp, first_seed=d.first_seed, seeds=d.seeds, steps=d.steps, confirmatory=str(shown),
                               declaration=fixed)  # fmt: skip


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
