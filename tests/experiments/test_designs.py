"""The declared designs themselves: every preset of every experiment definition stays within the runner's epoch
limit on the embedded corpus (the >1-epoch pitfall: a larger model's loss would measure memorisation), and the
runner refuses a design past it; a definition file that is not plain YAML is one line naming it."""

from __future__ import annotations

import dataclasses

import pytest

from moe_lm.config import load_config
from moe_lm.data.prepare import prepare_data
from moe_lm.errors import RunError
from moe_lm.experiments import runner
from moe_lm.experiments.spec import EXPERIMENTS_DIR, load_experiment


def arm_configs(tmp_path, prepared: dict):
    """(experiment, preset, arm, config with its data prepared under tmp_path) for every declared design."""
    for path in sorted(EXPERIMENTS_DIR.glob("*.yaml")):
        for preset in (None, "gpu", "long"):
            exp = load_experiment(path.stem, preset)
            if not exp.arms:  # a probe of another experiment's runs (rank)
                continue
            for arm, overrides in exp.arms.items():
                cfg = load_config(exp.config, [*exp.overrides, *overrides, f"train.max_steps={exp.steps}"])
                key = (cfg.model.vocab_size, tuple(cfg.data.sources), cfg.data.max_mb_per_domain)
                if key not in prepared:
                    data = dataclasses.replace(cfg.data, out_dir=str(tmp_path / f"data{len(prepared)}"))
                    prepare_data(data, cfg.model.vocab_size, seed=0, log=lambda line: None)
                    prepared[key] = data.out_dir
                yield (
                    exp,
                    preset,
                    arm,
                    dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, out_dir=prepared[key])),
                )


def test_every_declared_design_stays_within_the_epoch_limit(tmp_path):
    seen = []
    for exp, preset, arm, cfg in arm_configs(tmp_path, {}):
        assert runner.epochs(cfg) <= runner.MAX_EPOCHS, (exp.name, preset, arm, runner.epochs(cfg))
        runner.check_epochs(cfg, exp, arm)
        seen.append((exp.name, preset))
    assert {("mask", "gpu"), ("moe-dense", "gpu"), ("balance", "long")} <= set(seen)
    exp, _, arm, cfg = next(arm_configs(tmp_path, {}))
    steps = int(cfg.train.max_steps * (runner.MAX_EPOCHS + 0.5) / runner.epochs(cfg))  # 4.5 passes
    longer = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=steps))
    with pytest.raises(RunError, match=r"4.5 passes over .* training split .* fewer steps, or more data"):
        runner.check_epochs(longer, exp, arm)


@pytest.mark.parametrize("tagged", ["arms: !!python/object/apply:os.system [echo ran]", "claim: !mine tagged"])
def test_a_yaml_tag_in_a_definition_is_one_line_naming_the_file(tmp_path, cli, tagged):
    path = tmp_path / "tagged.yaml"
    path.write_text(f"config: ../tiny.yaml\n{tagged}\n")
    proc = cli("experiment", path, "--runs", tmp_path / "runs")
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: {path}: invalid YAML, line 2, column ")
    assert "could not determine a constructor for the tag" in line


def test_every_registered_variant_is_used_by_a_shipped_definition():
    """The ownership rule (docs/experiments.md §5): a variant lives as long as a shipped experiment uses it; one that
    no definition names any more is removed, with its tests."""
    import moe_lm.experiments.variants  # noqa: F401 - registers them
    from moe_lm.model.architectures import ARCHITECTURES
    from moe_lm.model.masks import MASKS
    from moe_lm.train.objective import OBJECTIVES

    used = {"model.attn_mask": set(), "objective.name": set(), "model.arch": set()}
    for path in sorted(EXPERIMENTS_DIR.glob("*.yaml")):
        for preset in (None, "gpu", "long"):
            exp = load_experiment(path.stem, preset, extended=True)
            for overrides in [exp.overrides, *exp.arms.values()]:
                for override in overrides:
                    key, _, value = override.partition("=")
                    if key in used:
                        used[key].add(value)
    core = {"model.attn_mask": "causal", "objective.name": "lm", "model.arch": "decoder"}
    for key, registry in (("model.attn_mask", MASKS), ("objective.name", OBJECTIVES), ("model.arch", ARCHITECTURES)):
        unused = set(registry) - used[key] - {core[key]}
        assert not unused, f"{key} {sorted(unused)}: registered by a variant no shipped experiment uses; remove it"
