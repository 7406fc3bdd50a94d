"""An experiment definition: a claim, the arms that test it, and the verdict rule, read from YAML.

    configs/experiments/moe-dense.yaml
        claim: ...            what is tested, in one sentence
        source: ...           where the claim comes from (paper, table)
        config: ../tiny.yaml  the base preset (relative to this file)
        overrides: [...]      dotted overrides for every arm
        steps: 360            train.max_steps of every run (--steps)
        seeds: 3              seeds 0 .. n-1 (--seeds); the seed fixes initialisation and data order, so arms are
                              paired by seed
        score_from: 1         evaluation scores the tokens from this window position on (128: the prefix-LM targets)
        measures: [routing]   beyond the loss, the measures registered in measures.py: routing (MaxVio_global,
                              domain JSD and its token-shuffled baseline), attention_rank (effective rank of the
                              attention matrices: metric erank)
        arms:                 name -> overrides
        extended_arms:        more arms, run with --extended
        comparisons:          each: delta = metric(a) - metric(b) per seed, and the prediction to test
          - {a: moe, b: dense-active, metric: loss, expect: lower}
          - {a: moe, b: dense-total, metric: loss, expect: not_lower, margin: 0.02}
        presets:              named variants (--preset gpu): keys replace the top-level ones

`expect` is fixed before anything runs: lower / higher (a below / above b; no margin), not_lower / not_higher (a does
not beat b by more than `margin`, e.g. "bidirectional attention brings no gain"), equivalent (|a - b| < `margin`,
two one-sided tests); the three "no effect" claims need a margin > 0. See stats.verdict for the rule. `role`:
claim (judged), premise (judged; if not supported, the verdict is "premise not met"), context (not judged).
A preset resizes the experiment but cannot change its comparisons, claim or arm names; a run with other seeds,
steps or --extended arms than the definition is exploratory: reported, never judged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from moe_lm.config import ConfigError, safe_yaml, yaml_problem
from moe_lm.errors import shown
from moe_lm.experiments.measures import MEASURES, METRICS, PROBES

EXPERIMENTS_DIR = Path(__file__).resolve().parents[1] / "configs" / "experiments"  # shipped with the package
EXPECTATIONS = ("lower", "higher", "not_lower", "not_higher", "equivalent")
NEEDS_MARGIN = ("not_lower", "not_higher", "equivalent")  # "no effect" claims: the largest effect that is none
ROLES = ("claim", "premise", "context")
PRESET_MAY_NOT_SET = ("comparisons", "extended_arms", "claim", "verdict")  # what is judged is the definition's


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    metric: str = "loss"
    expect: str = "lower"
    margin: float = 0.0  # for not_lower / not_higher / equivalent: the largest effect that still counts as none
    label: str = ""
    # "claim": part of the verdict; "premise": what the claim presupposes (not met: the verdict says so, instead
    # of judging the claim); "context": reported with its interval, not judged
    role: str = "claim"

    @property
    def name(self) -> str:
        return self.label or f"{self.a} - {self.b}"


@dataclass
class Experiment:
    name: str
    claim: str
    source: str
    config: Path
    arms: dict[str, list[str]]
    comparisons: list[Comparison]
    overrides: list[str] = field(default_factory=list)
    steps: int = 360
    seeds: int = 3
    score_from: int = 1
    measures: list[str] = field(default_factory=list)
    verdict: str = ""
    untested: list[str] = field(default_factory=list)
    notes: str = ""
    # a probe experiment measures the runs of another experiment (`arms_from`, e.g. rank on mask's checkpoints)
    probe: str = ""
    arms_from: str = ""
    probe_arms: list[str] = field(default_factory=list)
    windows: int = 32
    # why this run deviates from the definition (--seeds, --steps, --extended): reported, never judged
    exploratory: str = ""
    preset: str = ""  # the declared preset applied (--preset/--long), for the reproduce command
    first_seed: int = 0  # seeds first_seed .. first_seed + seeds - 1 (a confirmatory round's fresh ones)
    confirmatory: str = ""  # the declaration a confirmatory round follows (moe_lm/experiments/declaration.py)
    declaration: dict | None = None  # its sha256 and the commit that fixed it (declaration.provenance)

    @property
    def seed_ids(self) -> range:
        return range(self.first_seed, self.first_seed + self.seeds)


def load_experiment(name_or_path: str, preset: str | None = None, extended: bool = False) -> Experiment:
    """The experiment `configs/experiments/NAME.yaml` (or a path to such a file), with a preset applied."""
    path = Path(name_or_path)
    if not path.suffix:
        path = EXPERIMENTS_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml")))
        raise ConfigError(f"no experiment {name_or_path!r} ({path} not found); defined: {known}")
    try:
        raw = safe_yaml(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML, {yaml_problem(e)}") from None
    presets = raw.pop("presets", {}) or {}
    if raw.get("arms_from"):  # a probe: the arms (and their schedule) are the other experiment's
        other = str(raw["arms_from"])
        source = load_experiment(str(path.parent / other) if Path(other).suffix else other, preset, extended)
        raw.setdefault("arms", source.arms)
        # and its judged comparisons, which the probe reads off the probed runs themselves (rank: the mask effect)
        raw.setdefault("comparisons", [dataclasses.asdict(c) for c in source.comparisons])
        for key in ("steps", "seeds", "overrides", "score_from"):
            raw.setdefault(key, getattr(source, key))
        raw.setdefault("config", str(source.config))
    if preset and preset in presets:
        _check_preset(path, preset, presets[preset], raw)
        raw.update(presets[preset])
    elif preset and not raw.get("arms_from"):  # a probe takes its source experiment's preset
        raise ConfigError(f"{path}: no preset {preset!r}; defined: {', '.join(presets) or 'none'}")
    extended_arms = raw.pop("extended_arms", {}) or {}
    arms = {str(k): list(v or []) for k, v in (raw.pop("arms", None) or {}).items()}
    if extended:
        arms.update({str(k): list(v or []) for k, v in extended_arms.items()})
    comparisons = []
    for c in raw.pop("comparisons", []) or []:
        comparisons.append(Comparison(**c))
    known = {"claim", "source", "config", "overrides", "steps", "seeds", "score_from", "measures", "verdict",
             "untested", "notes", "probe", "arms_from", "probe_arms", "windows"}  # fmt: skip
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; valid: {sorted(known | {'arms', 'comparisons'})}")
    exp = Experiment(
        exploratory="--extended runs arms beyond the definition" if extended and extended_arms else "",
        preset=preset if preset and preset in presets else "",
        name=path.stem,
        arms=arms,
        comparisons=[c for c in comparisons if c.a in arms and c.b in arms],
        **{k: v for k, v in raw.items() if k != "config"},
        config=(path.parent / raw.get("config", "../tiny.yaml")).resolve(),
    )
    _check(exp, path, comparisons, set(arms) | set(extended_arms))
    return exp


def _check_preset(path: Path, name: str, preset: dict, raw: dict) -> None:
    """A preset resizes an experiment (its config, steps, overrides, the arms' settings); it cannot change what is
    judged: the comparisons, the claim, or which arms exist."""
    touched = sorted(set(preset) & set(PRESET_MAY_NOT_SET))
    if touched:
        raise ConfigError(f"{path}: preset {name!r} sets {touched}: a preset may not change what is judged")
    if "arms" in preset and set(preset["arms"]) != set(raw.get("arms") or {}):
        raise ConfigError(f"{path}: preset {name!r} must define the same arms as the experiment, with other settings")


def _check(exp: Experiment, path: Path, comparisons: list[Comparison], all_arms: set[str]) -> None:
    if not exp.arms:
        raise ConfigError(f"{path}: no arms")
    for c in comparisons:  # (a comparison with an --extended arm is dropped without --extended)
        missing = [arm for arm in (c.a, c.b) if arm not in all_arms]
        if missing:
            raise ConfigError(f"{path}: comparison {c.name} names arms {missing} that are not defined")
        if c.expect not in EXPECTATIONS:
            raise ConfigError(f"{path}: comparison {c.name}: expect must be one of {EXPECTATIONS}, got {c.expect!r}")
        if c.role not in ROLES:
            raise ConfigError(f"{path}: comparison {c.name}: role must be one of {ROLES}, got {c.role!r}")
        if c.expect in NEEDS_MARGIN and not c.margin > 0:
            raise ConfigError(
                f"{path}: comparison {c.name}: expect {c.expect} needs a margin > 0, declared before the runs (the "
                "largest effect that still counts as none)"
            )
        if c.expect not in NEEDS_MARGIN and c.margin:
            raise ConfigError(f"{path}: comparison {c.name}: expect {c.expect} takes no margin (got {c.margin})")
        if c.metric not in METRICS:
            raise ConfigError(f"{path}: comparison {c.name}: metric must be one of {list(METRICS)}, got {c.metric!r}")
        need = METRICS[c.metric].measure
        if need and need not in exp.measures:
            raise ConfigError(f"{path}: comparison {c.name} uses {c.metric}, which needs `measures: [{need}]`")
    unknown = set(exp.measures) - set(MEASURES)
    if unknown:
        raise ConfigError(f"{path}: unknown measures {sorted(unknown)}; valid: {list(MEASURES)}")
    if exp.probe and exp.probe not in PROBES:
        raise ConfigError(f"{path}: unknown probe {exp.probe!r}; valid: {list(PROBES)}")
    # an unquoted "- Why: because" item is a YAML mapping, which the report would print as a Python dict
    odd = [u for u in exp.untested if not isinstance(u, str)]
    if odd:
        raise ConfigError(f"{path}: `untested` items must be text, got {shown(odd)}: quote an item that holds ': '")
    if exp.steps < 1 or exp.seeds < 1 or exp.score_from < 1:
        raise ConfigError(f"{path}: steps, seeds and score_from must be >= 1")
