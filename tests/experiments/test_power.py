"""The power of a design (moe_lm/experiments/power.py) against closed forms, and `moe-lm experiment --power`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from moe_lm.experiments.power import TARGET, seeds_needed, verdict_probabilities
from moe_lm.experiments.stats import t_quantile


@pytest.mark.parametrize("mean, sd, n, margin", [(0.0, 0.02, 6, 0.01), (-0.005, 0.03, 10, 0.01), (0.02, 0.05, 4, 0.02)])
def test_not_lower_is_a_one_sided_t_test_whose_power_is_the_noncentral_t(mean, sd, n, margin):
    """not_lower is supported when the 95 % interval's low end lies above -margin: (mean_n + margin) / (s / sqrt(n))
    above Student's 97.5 % quantile, whose probability is the noncentral t's tail (non-centrality
    (mean + margin) sqrt(n) / sd)."""
    supported, _ = verdict_probabilities(mean, sd, n, "not_lower", margin)
    exact = scipy_stats.nct.sf(t_quantile(n - 1, 0.975), n - 1, (mean + margin) * math.sqrt(n) / sd)
    assert supported == pytest.approx(exact, abs=0.01)


def test_on_the_threshold_a_design_clears_it_two_and_a_half_percent_of_the_time():
    supported, contradicted = verdict_probabilities(-0.01, 0.03, 8, "not_lower", 0.01)
    assert supported == pytest.approx(0.025, abs=0.004) and contradicted == pytest.approx(0.025, abs=0.004)


def test_lower_needs_every_seed_to_agree_so_small_effects_never_reach_a_verdict():
    """P(supported) <= P(all n seeds below 0) = Phi(-mean / sd)^n, and <= the interval's own probability."""
    mean, sd = -0.01, 0.05
    for n in (3, 10, 30):
        supported, _ = verdict_probabilities(mean, sd, n, "lower")
        all_agree = scipy_stats.norm.cdf(-mean / sd) ** n
        interval = scipy_stats.nct.cdf(-t_quantile(n - 1, 0.975), n - 1, mean * math.sqrt(n) / sd)
        assert supported <= min(all_agree, interval) + 0.005
    p = seeds_needed([-0.06, 0.04, 0.0], "lower")  # mean -0.007, sd 0.05: the clause wins, nothing reaches 80 %
    assert p.seeds is None and p.p_verdict < TARGET


def test_seeds_needed_is_the_smallest_design_that_reaches_the_target():
    deltas = [0.012, -0.004, 0.008]  # mean +0.0053, sd 0.008, against a margin of 0.01
    p = seeds_needed(deltas, "not_higher", 0.01)
    mean, sd = float(np.mean(deltas)), float(np.std(deltas, ddof=1))
    assert p.seeds is not None and p.p_verdict >= TARGET
    assert sum(verdict_probabilities(mean, sd, p.seeds - 1, "not_higher", 0.01)) < TARGET
    big = seeds_needed([-0.9, -0.8, -0.85], "lower")  # a large effect against its spread
    assert big.seeds == 2 and big.p_supported > TARGET


def test_power_prints_every_committed_report_of_an_experiment(cli):
    proc = cli("experiment", "mtp", "--power")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| main-head loss")]
    assert any("docs/results/mtp (pilot)" in row and "| 3 x 360 |" in row for row in rows), rows
    # the confirmatory round committed beside it (docs/results/confirmatory/mtp: 6 seeds), its own row
    assert any("docs/results/confirmatory/mtp (confirmatory)" in row and "| 6 x 360 |" in row for row in rows), rows
    assert cli("experiment", "mtp", "--power", "--results", "no/such/folder").returncode == 2


@pytest.mark.parametrize(
    "comparison, said",
    [({"name": "loss", "deltas": [0.1, 0.2]}, "comparison 'loss': role is None"),  # an older or hand-made report
     ({"name": "loss", "role": "claim", "metric": "loss", "verdict": "supported", "mean": 0.1, "t_interval": [0, 1],
       "deltas": [0.1, None], "expect": "lower", "margin": 0}, "deltas [0.1, None] are not all finite numbers")],
)  # fmt: skip
def test_power_over_a_report_of_another_shape_is_one_line_naming_it(tmp_path, cli, comparison, said):
    """`--power` over such a report ended in `KeyError: 'role'`, and over a two-seed pilot with a missing delta in
    `ValueError: a pilot of 2 seed gives no spread`; `--table` already named the file. A results.json of another
    experiment or tool under the folder is none of this experiment's reports, and is passed over."""
    report = {"experiment": "mtp", "claim": "c", "verdict": "supported", "steps": 10, "comparisons": [comparison]}
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "results.json").write_text(json.dumps(report))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "results.json").write_text('{"accuracy": 0.5}')
    proc = cli("experiment", "mtp", "--power", "--results", tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert str(tmp_path / "mine" / "results.json") in lines[0] and said in lines[0], lines[0]


def test_a_declaration_is_sized_from_its_pilot_and_copies_what_is_judged(tmp_path, cli, monkeypatch):
    import yaml

    from moe_lm.experiments import declaration
    from moe_lm.experiments.declaration import declare, definition_hash
    from moe_lm.experiments.spec import EXPERIMENTS_DIR, load_experiment

    exp = load_experiment("mtp")
    pilot = {"steps": 360, "comparisons": [
        {"name": "main-head loss, D = 1 vs D = 0", "role": "claim", "expect": "not_higher", "margin": 0.01,
         "deltas": [-0.02, -0.06, -0.04]}]}  # fmt: skip
    record = yaml.safe_load(declare(exp, EXPERIMENTS_DIR / "mtp.yaml", pilot, 360, "as the pilot"))
    sized = seeds_needed([-0.02, -0.06, -0.04], "not_higher", 0.01)
    assert record["seeds"] == sized.seeds and record["first_seed"] >= exp.seeds and record["steps"] == 360
    assert record["definition_sha256"] == definition_hash(EXPERIMENTS_DIR / "mtp.yaml")
    assert record["comparisons"][0]["margin"] == 0.01 and record["arms"] == ["d0", "d1"]
    # the command writes it once, and never over a declaration that stands
    monkeypatch.setattr(declaration, "DECLARATIONS_DIR", tmp_path / "confirmatory")
    (tmp_path / "results" / "mtp").mkdir(parents=True)
    (tmp_path / "results" / "mtp" / "results.json").write_text(json.dumps(pilot))
    argv = ["experiment", "mtp", "--declare", "as the pilot", "--results", tmp_path / "results"]
    assert cli(*argv).returncode == 0 and (tmp_path / "confirmatory" / "mtp.yaml").is_file()
    again = cli(*argv)
    assert again.returncode == 2 and "a declaration stands" in again.stderr
