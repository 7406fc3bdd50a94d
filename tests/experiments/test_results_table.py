"""The committed experiment results (docs/results/NAME/results.json) and the README table generated from them: the
table is never edited by hand, every committed report is a declared design (not exploratory) run on the shipped
corpus, and an exploratory report is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_lm.config import load_config
from moe_lm.data.prepare import prepare_data
from moe_lm.errors import UserError
from moe_lm.experiments.provenance import data_fingerprint
from moe_lm.experiments.results_table import load_results, results_table
from moe_lm.experiments.spec import EXPERIMENTS_DIR

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
BEGIN, END = "<!-- results table: moe-lm experiment --table docs/results -->", "<!-- end of results table -->"


def test_the_readme_table_is_generated_from_the_committed_results():
    readme = (ROOT / "README.md").read_text()
    assert BEGIN in readme and END in readme, "the README lost its generated results table"
    block = readme.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"
    assert block == results_table(RESULTS), "README's table is stale: paste `moe-lm experiment --table docs/results`"


def test_every_committed_result_is_a_declared_design_on_the_shipped_corpus(tmp_path):
    results = load_results(RESULTS)
    table = results_table(RESULTS)
    for path in EXPERIMENTS_DIR.glob("*.yaml"):  # every shipped definition has its row, run or not
        assert f"| {path.stem} | " in table
    cfg = load_config(ROOT / "moe_lm" / "configs" / "tiny.yaml", [f"data.out_dir={tmp_path / 'data'}"])
    prepare_data(cfg.data, cfg.model.vocab_size, seed=0, log=lambda line: None)  # as the runner prepares it
    shipped = data_fingerprint(cfg.data.out_dir)
    for r in results:
        inputs = r["inputs"]
        assert {"data_fingerprint", "training_code", "evaluation_code", "commit"} <= set(inputs), r["experiment"]
        assert inputs["data_fingerprint"] == shipped, f"{r['experiment']} was run on another corpus"
        assert r["command"] == f"moe-lm experiment {r['experiment']}" and not r.get("exploratory")


def test_a_declared_round_not_yet_reported_says_so_with_its_design():
    """A declaration committed before its runs shows in the table as declared, with the design it fixed (read here
    from the declaration file itself), until its report is committed."""
    from moe_lm.experiments.declaration import DECLARATIONS_DIR, load_declaration

    confirmed = (
        {r["experiment"] for r in load_results(RESULTS / "confirmatory")}
        if (RESULTS / "confirmatory").is_dir()
        else set()
    )
    pending = [p.stem for p in sorted(DECLARATIONS_DIR.glob("*.yaml")) if p.stem not in confirmed]
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in results_table(RESULTS).splitlines()[2:]}
    for name in pending:
        d = load_declaration(name)
        assert rows[name][3].startswith(f"declared, not yet reported: {d.seeds} seeds x {d.steps} steps from seed "
                                        f"{d.first_seed} (configs/experiments/confirmatory/{name}.yaml")  # fmt: skip
    for name in confirmed:
        assert rows[name][3].startswith("**"), rows[name][3]


def test_an_exploratory_report_is_refused(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "results.json").write_text(json.dumps({"experiment": "x", "exploratory": "--seeds 1"}))
    with pytest.raises(UserError, match="exploratory"):
        results_table(tmp_path)
    with pytest.raises(UserError, match="no \\*/results.json"):
        results_table(tmp_path / "x")


@pytest.mark.parametrize(
    "content, said",
    [("[1, 2]", "a list, not an object"), ('{"experiment": "x"', "not JSON"),
     ('{"foo": 1}', "experiment is None"), ('{"experiment": "x", "claim": "c", "verdict": 3}', "verdict is 3"),
     ('{"experiment": "x", "claim": "c", "verdict": "supported", "comparisons": [{"name": "a", "role": "claim"}]}',
      "comparison 'a': metric is None"),
     ('{"experiment": "x", "claim": "c", "verdict": "supported", "checks": [{"name": "r", "role": "claim", '
      '"verdict": "supported", "mean": 1.0}]}', "check 'r': t_interval is None")],
)  # fmt: skip
def test_a_report_of_another_shape_is_one_line_naming_it(tmp_path, cli, content, said):
    """`--table` over a folder holding another tool's results.json, or a report of another shape, ended in a KeyError
    or a ValueError."""
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "results.json").write_text(content)
    proc = cli("experiment", "--table", tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert str(tmp_path / "x" / "results.json") in proc.stderr and said in proc.stderr, proc.stderr


def test_a_row_names_each_judged_comparison_once_and_leaves_out_context(tmp_path):
    """Pilot and confirmatory round side by side, each with its seeds and steps; context rows left out; a claim
    still open says what its last report's power estimate asks for."""

    def comparison(role, name, mean, verdict, deltas):
        return {"role": role, "name": name, "metric": "loss", "mean": mean, "t_interval": [mean - 0.05, mean + 0.05],
                "verdict": verdict, "relative_percent": 2.0, "seeds": list(range(len(deltas))), "deltas": deltas,
                "expect": "lower", "margin": 0.0}  # fmt: skip

    def report(folder, verdict, command, comparisons):
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps({
            "experiment": "x", "claim": "a claim", "verdict": verdict, "command": command, "steps": 360,
            "comparisons": comparisons}))  # fmt: skip

    report(tmp_path / "x", "inconclusive", "moe-lm experiment x.yaml",
           [comparison("claim", "a beats b", -0.02, "inconclusive", [-0.05, -0.04, -0.045]),
            comparison("context", "a against d", 0.5, "-", [0.4, 0.5, 0.6])])  # fmt: skip
    row = next(line for line in results_table(tmp_path).splitlines() if line.startswith("| x |"))
    cells = [c.strip() for c in row.split(" | ")]
    assert cells[2] == ("**inconclusive** (3 seeds x 360 steps): a beats b: -0.020 (-0.070, +0.030), +2.0 % → "
                        "inconclusive (`moe-lm experiment x.yaml`)")  # fmt: skip
    # no declaration: the cell says how to write one, never suggests --confirm alone (it would be refused)
    assert cells[3] == ("none declared yet: `moe-lm experiment x --declare WHY` writes one from the pilot, then "
                        "`--confirm` runs it")  # fmt: skip
    assert cells[4].startswith("a beats b: ") and cells[4].endswith(" seeds at 360 steps |")
    assert "a against d" not in row
    report(tmp_path / "confirmatory" / "x", "supported", "moe-lm experiment x --confirm",
           [comparison("claim", "a beats b", -0.03, "supported", [-0.03] * 8)])  # fmt: skip
    row = next(line for line in results_table(tmp_path).splitlines() if line.startswith("| x |"))
    cells = [c.strip() for c in row.split(" | ")]
    assert cells[3].startswith("**supported** (8 seeds x 360 steps): a beats b: -0.030") and cells[4] == "- |"


def test_a_claim_without_a_declaration_says_why(tmp_path):
    """Without a declaration the confirmatory cell gives the reason from the pilot: a decided verdict stands, an
    open claim whose every row reaches no verdict up to 200 seeds (a zero-mean spread) needs scale, not a round."""
    folder = tmp_path / "x"
    folder.mkdir()

    def row(verdict, deltas):
        comparison = {"role": "claim", "name": "a beats b", "metric": "loss", "mean": 0.0, "expect": "lower",
                      "t_interval": [-0.1, 0.1], "verdict": verdict, "seeds": [0, 1, 2], "deltas": deltas,
                      "margin": 0.0}  # fmt: skip
        (folder / "results.json").write_text(json.dumps({
            "experiment": "x", "claim": "c", "verdict": verdict, "command": "moe-lm experiment x", "steps": 360,
            "comparisons": [comparison]}))  # fmt: skip
        line = next(line for line in results_table(tmp_path).splitlines() if line.startswith("| x |"))
        return [c.strip() for c in line.split(" | ")]

    cells = row("contradicted", [0.1, 0.12, 0.09])
    assert cells[3].startswith("none declared: the pilot's verdict (contradicted) stands;") and cells[4] == "- |"
    cells = row("inconclusive", [-0.1, 0.1, 0.0])  # mean 0, sd 0.1: "lower" with every seed agreeing is out of reach
    assert cells[3] == "none declared: no design up to 200 seeds reaches a verdict at this schedule (last column)"
    assert "no design up to 200 seeds at 360 steps" in cells[4]
    assert "--confirm" not in " ".join(cells)
