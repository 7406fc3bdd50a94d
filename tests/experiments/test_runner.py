"""The experiment runner: arms x seeds trained through the real command, cached by config (and shared between
experiments), the whole-split evaluation against a direct computation, and the report."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from moe_lm.checkpoint.format import load_model
from moe_lm.config import ConfigError, dump_config
from moe_lm.data.prepare import load_split
from moe_lm.errors import RunError
from moe_lm.experiments import runner
from moe_lm.experiments.arm_data import ArmData
from moe_lm.experiments.attention_probe import attention_matrices, capture_attention, probe_windows
from moe_lm.experiments.curves import eval_curve, train_seconds
from moe_lm.experiments.final_eval import document_windows, evaluate_run
from moe_lm.experiments.provenance import data_fingerprint, evaluation_code, training_code
from moe_lm.experiments.report import write_report
from moe_lm.experiments.routing_measure import relative_load
from moe_lm.experiments.runner import resolve_run, run_experiment
from moe_lm.experiments.spec import load_experiment
from tests.helpers.runs import tiny_train_cfg

# why `process` in tests that do not call it: run_experiment and runner.execute train each arm in a process of its
# own (the real training command, as a user's experiment does); the fixture marks these tests integration


def definition(folder, base, name: str = "exp", **extra) -> str:
    spec = {
        "claim": "two experts per token beat one",
        "source": "a test",
        "config": str(base),
        "steps": 3,
        "seeds": 2,
        "overrides": ["cadence.eval_interval=3"],
        "arms": {"k2": [], "k1": ["model.moe.num_experts_per_tok=1"]},
        "comparisons": [{"a": "k2", "b": "k1", "metric": "loss", "expect": "lower"}],
        **extra,
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_data):
    folder = tmp_path_factory.mktemp("exp")
    dump_config(tiny_train_cfg(tiny_data, folder / "unused", eval_batches=1), folder / "base.yaml")
    return folder / "base.yaml"


@pytest.fixture(scope="module")
def pilot(base, tmp_path_factory, process):
    """The two-arm, two-seed experiment trained and evaluated once (four runs, each a process of its own): the first
    run_experiment of its runs root, which the tests below read (and share, as experiments share runs)."""
    folder = tmp_path_factory.mktemp("pilot")
    exp = load_experiment(definition(folder, base, measures=["routing"]))
    return exp, folder / "runs", run_experiment(exp, folder / "runs", log=lambda s: None)


def test_runs_are_cached_shared_and_reported(pilot, base, tmp_path, monkeypatch, cli):
    exp, runs_root, runs = pilot
    assert [(r.arm, r.seed, r.cached) for r in runs] == [("k2", 0, False), ("k1", 0, False), ("k2", 1, False),
                                                         ("k1", 1, False)]  # fmt: skip
    assert len({r.folder for r in runs}) == 4 and all((r.folder / "final_eval.npz").is_file() for r in runs)
    logs = {r.folder: (r.folder / "train.log").stat().st_size for r in runs}
    # the same command again: nothing is trained or evaluated again
    again = run_experiment(exp, runs_root, log=lambda s: None)
    assert all(r.cached for r in again) and [r.result for r in again] == [r.result for r in runs]
    assert {r.folder: (r.folder / "train.log").stat().st_size for r in again} == logs
    # another experiment with an identical arm shares its runs; more steps are other runs
    other = load_experiment(
        definition(tmp_path, base, name="other", arms={"k2": [], "wide": ["model.dim=64"]}, comparisons=[])
    )
    assert resolve_run(other, "k2", 1, runs_root).folder == runs[2].folder
    longer = load_experiment(definition(tmp_path, base, steps=4))
    assert resolve_run(longer, "k2", 0, runs_root).folder != runs[0].folder
    # an evaluation lost (or asked differently) is redone from the checkpoint, without training again
    (runs[0].folder / "final_eval.json").unlink()
    redo = run_experiment(exp, runs_root, log=lambda s: None)[0]
    assert not redo.cached and redo.result == runs[0].result
    assert (runs[0].folder / "train.log").stat().st_size == logs[runs[0].folder]
    # ... and so is one cut short (a crash or a full disk while an older version wrote it): not a JSONDecodeError
    # on every start until removed by hand
    for cut in ("", '{"loss": 3.1'):
        (runs[0].folder / "final_eval.json").write_text(cut)
        redo = run_experiment(exp, runs_root, log=lambda s: None)[0]
        assert not redo.cached and redo.result == runs[0].result

    results = write_report(exp, runs, tmp_path / "report", n_boot=200)
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Comparisons" in report and results["verdict"] in report
    (c,) = results["comparisons"]
    assert len(c["deltas"]) == 2
    assert c["deltas"][0] == pytest.approx(runs[0].result["loss"] - runs[1].result["loss"])
    assert c["verdict"] in ("supported", "contradicted", "inconclusive")
    figures = {"curves.png", "deltas.png", "maxvio_batch.png", "relative_load.png"}
    assert figures <= {p.name for p in (tmp_path / "report/figures").iterdir()}
    assert "## Training" in report and results["command"] == f"moe-lm experiment {exp.name}"
    check_training_numbers(results, runs)
    check_relative_load(runs)
    saved = json.loads((tmp_path / "report" / "results.json").read_text())
    assert saved["arms"][1]["active_params"] < saved["arms"][0]["active_params"]  # k1 runs fewer experts
    layer = next(iter(runs[0].result["routing"].values()))
    assert {"maxvio_global", "maxvio_floor", "domain_jsd", "domain_jsd_init", "domain_jsd_shuffled"} <= set(layer)
    assert c["seeds"] == [0, 1] and "seed_document_bootstrap" in c and "bootstrap" not in c

    # fewer seeds than the definition's (its runs are cached): exploratory, reported but not judged
    proc = cli("experiment", definition(tmp_path, base, measures=["routing"]), "--runs", runs_root, "--seeds", "1",
               "--out", tmp_path / "fewer", "--boot", "50")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    fewer = json.loads((tmp_path / "fewer" / "results.json").read_text())
    assert fewer["verdict"] == "exploratory (no verdict)"
    assert fewer["exploratory"] == "--seeds 1 where the definition has 2"
    assert "**Exploratory**: --seeds 1 where the definition has 2" in (tmp_path / "fewer" / "report.md").read_text()

    # pinned inputs: the report names them; other code is another run; runs of different inputs are not compared
    assert results["inputs"]["data_fingerprint"] == data_fingerprint(runs[0].cfg.data.out_dir)
    assert results["inputs"]["training_code"] == training_code()
    assert results["inputs"]["evaluation_code"] == evaluation_code()
    monkeypatch.setattr(runner, "training_code", lambda: "0" * 16)  # other training code: another run
    assert resolve_run(exp, "k2", 0, runs_root).folder != runs[0].folder
    monkeypatch.undo()
    monkeypatch.setattr(runner, "evaluation_code", lambda: "0" * 16)  # other evaluation code: evaluated again
    assert resolve_run(exp, "k2", 0, runs_root).folder == runs[0].folder and not runner.is_done(runs[0], exp)
    monkeypatch.undo()
    elsewhere = {**runs[1].result, "inputs": {**runs[1].result["inputs"], "data_fingerprint": "elsewhere"}}
    mixed = [runs[0], dataclass_replace(runs[1], result=elsewhere), *runs[2:]]
    with pytest.raises(RunError, match=r"different data or code.*data elsewhere.*: k1/0"):
        write_report(exp, mixed, tmp_path / "mixed", n_boot=10)


def test_an_attempt_killed_before_its_first_checkpoint_is_set_aside_and_run_again(base, tmp_path, process):
    exp = load_experiment(definition(tmp_path, base, seeds=1))
    run = resolve_run(exp, "k1", 0, tmp_path / "runs")
    run.folder.mkdir(parents=True)
    (run.folder / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 9.0}\n')  # then killed
    done = runner.execute(run, exp, log=lambda s: None)
    assert done.result["loss"] > 0 and runner.is_done(done, exp)
    (aside,) = (tmp_path / "runs").glob(f"{run.folder.name}.prev-*")
    assert (aside / "metrics.jsonl").read_text().startswith('{"kind": "train", "step": 1, "loss": 9.0}')


def test_a_run_in_use_is_refused_and_never_moved(base, tmp_path, process):
    """Two experiment commands sharing a run: the second moved the first's live run aside as "an interrupted attempt"
    while its trainer ran (its config and first metrics in the .prev folder, its checkpoint in the other). A run
    whose trainer holds <run>/.lock, or that another experiment command holds, is refused and left as it is."""
    import fcntl

    exp = load_experiment(definition(tmp_path, base, seeds=1))
    run = resolve_run(exp, "k1", 0, tmp_path / "runs")
    run.folder.mkdir(parents=True)
    (run.folder / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 9.0}\n')  # no checkpoint yet
    with open(run.folder / ".lock", "a+") as trainer:  # as moe_lm.train.run_folder holds it while training
        trainer.write("pid 4242 on elsewhere")
        trainer.flush()
        fcntl.flock(trainer, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RunError, match="in use by a training process \\(pid 4242 on elsewhere\\)"):
            runner.execute(run, exp, log=lambda s: None)
    assert sorted(p.name for p in run.folder.iterdir()) == [".lock", "metrics.jsonl"]
    assert not list((tmp_path / "runs").glob("*.prev-*"))
    with runner.run_lock(run), pytest.raises(RunError, match="in use by another experiment command \\(pid"):
        runner.execute(run, exp, log=lambda s: None)
    assert not list((tmp_path / "runs").glob("*.prev-*"))


def test_final_evaluation_equals_a_direct_computation(pilot, base, tmp_path):
    """The batched, padded whole-split evaluation against one window at a time; and prefix scoring counts only the
    positions from score_from on."""
    exp = load_experiment(definition(tmp_path, base, seeds=1))
    (run,) = run_experiment(dataclass_replace(exp, arms={"k2": []}), pilot[1], log=lambda s: None)  # the pilot's
    cfg, model, _ = load_model(run.folder)
    shard = load_split(cfg.data.out_dir, "val")
    nll = n = 0.0
    with torch.no_grad():
        for d in range(shard.n_docs):
            for w in document_windows(np.asarray(shard.document(d)), cfg.train.seq_len):
                w = torch.from_numpy(w.astype(np.int64))[None]
                if w.shape[1] < 2:
                    continue
                logits = model(w[:, :-1]).logits
                nll += F.cross_entropy(logits[0], w[0, 1:], reduction="sum").item()
                n += w.shape[1] - 1
    assert run.result["loss"] == pytest.approx(nll / n, rel=1e-5) and run.result["labels"] == n
    scored = evaluate_run(run.folder, score_from=10)
    windows = [
        w for d in range(shard.n_docs) for w in document_windows(np.asarray(shard.document(d)), cfg.train.seq_len)
    ]
    expected = sum(len(w) - 10 for w in windows if len(w) > 10)  # labels t_10 .. : window positions 9 ..
    assert scored["labels"] == expected


def test_definition_errors_name_the_problem(base, tmp_path):
    with pytest.raises(ConfigError, match="no experiment 'nope'.*defined: .*moe-dense"):
        load_experiment("nope")
    bad = definition(tmp_path, base, comparisons=[{"a": "k2", "b": "k3", "metric": "loss", "expect": "lower"}])
    with pytest.raises(ConfigError, match=r"names arms \['k3'\]"):
        load_experiment(bad)
    bad = definition(tmp_path, base, comparisons=[{"a": "k2", "b": "k1", "metric": "maxvio_global"}])
    with pytest.raises(ConfigError, match="needs `measures: \\[routing\\]`"):
        load_experiment(bad)
    bad = definition(tmp_path, base, comparisons=[{"a": "k2", "b": "k1", "metric": "erank", "role": "context"}])
    with pytest.raises(ConfigError, match="needs `measures: \\[attention_rank\\]`"):
        load_experiment(bad)
    with pytest.raises(ConfigError, match=r"unknown measures \['rank'\]"):
        load_experiment(definition(tmp_path, base, measures=["rank"]))
    with pytest.raises(ConfigError, match="no preset 'gpu'"):
        load_experiment(definition(tmp_path, base), preset="gpu")
    # an unquoted "- Why: because" in YAML is a mapping, which the report would print as a dict
    with pytest.raises(ConfigError, match=r"`untested` items must be text.*quote"):
        load_experiment(definition(tmp_path, base, untested=[{"Why": "because"}]))
    assert load_experiment(definition(tmp_path, base, untested=["Why: because"])).untested == ["Why: because"]
    # margins: required (> 0) where the claim is "no effect", refused where it is a direction
    for expect in ("not_lower", "not_higher", "equivalent"):
        bad = definition(tmp_path, base, comparisons=[{"a": "k2", "b": "k1", "expect": expect}])
        with pytest.raises(ConfigError, match=f"expect {expect} needs a margin > 0"):
            load_experiment(bad)
    bad = definition(tmp_path, base, comparisons=[{"a": "k2", "b": "k1", "expect": "lower", "margin": 0.01}])
    with pytest.raises(ConfigError, match="expect lower takes no margin"):
        load_experiment(bad)
    # a preset resizes the experiment; it cannot change what is judged
    judged = {"gpu": {"steps": 9, "comparisons": [{"a": "k1", "b": "k2", "expect": "lower"}]}}
    with pytest.raises(ConfigError, match=r"preset 'gpu' sets \['comparisons'\]"):
        load_experiment(definition(tmp_path, base, presets=judged), preset="gpu")
    renamed = {"gpu": {"arms": {"k2": [], "k3": []}}}
    with pytest.raises(ConfigError, match="preset 'gpu' must define the same arms"):
        load_experiment(definition(tmp_path, base, presets=renamed), preset="gpu")
    resized = {"gpu": {"steps": 9, "arms": {"k2": ["model.dim=64"], "k1": ["model.dim=64"]}}}
    assert load_experiment(definition(tmp_path, base, presets=resized), preset="gpu").steps == 9
    # --extended runs arms beyond the definition: exploratory
    more = definition(tmp_path, base, extended_arms={"k3": ["model.moe.num_experts_per_tok=3"]})
    assert load_experiment(more).exploratory == ""
    assert load_experiment(more, extended=True).exploratory == "--extended runs arms beyond the definition"


def check_training_numbers(results: dict, runs) -> None:
    """The report's training time, gap and curve times against the step rows read directly."""
    for arm_row in results["arms"]:
        for run, row in zip([r for r in runs if r.arm == arm_row["arm"]], arm_row["training"], strict=True):
            lines = [json.loads(line) for line in (run.folder / "metrics.jsonl").read_text().splitlines()]
            train = [r for r in lines if r["kind"] == "train"]
            evals = [r for r in lines if r["kind"] == "eval"]
            tail = [r["loss"] for r in train if r["step"] > 0.9 * train[-1]["step"]]
            domains = json.loads((Path(run.cfg.data.out_dir) / "manifest.json").read_text())["domains"]
            tokens = {d: v["tokens"]["train"] for d, v in domains.items()}
            mixed = sum(n * evals[-1][f"loss/{d}"] for d, n in tokens.items()) / sum(tokens.values())
            assert row["gap"] == pytest.approx(mixed - np.mean(tail), rel=1e-12)
            steps, loss, seconds = eval_curve(run, "loss")
            at = {r["step"]: r["train_seconds"] for r in train}
            assert seconds.tolist() == [at[s] for s in steps] and loss.tolist() == [r["loss"] for r in evals]
        times = [train_seconds(r) for r in runs if r.arm == arm_row["arm"]]
        assert arm_row["train_seconds"] == pytest.approx(np.mean(times)) and all(t > 0 for t in times)


def check_relative_load(runs) -> None:
    """DeepSeek-V3 Fig. 9's relative load against a loop over the documents' routed token-slots."""
    arm_runs = [r for r in runs if r.arm == "k2"]
    load = relative_load(ArmData(arm_runs))
    arrays = [np.load(r.folder / "final_eval.npz") for r in arm_runs]
    n_layers, E = arrays[0]["expert_counts"].shape[1:]
    for layer in range(n_layers):
        for d in range(int(arrays[0]["domain"].max()) + 1):
            slots = sum(a["expert_counts"][a["domain"] == d, layer].sum(0) for a in arrays)
            assert load[layer, d] == pytest.approx(slots / (slots.sum() / E), rel=1e-12)
    assert load.mean(-1) == pytest.approx(np.ones(load.shape[:2]))


def dataclass_replace(exp, **kw):
    import dataclasses

    return dataclasses.replace(exp, **kw)


def test_rank_probe_on_a_prefix_experiments_checkpoints(base, tmp_path, process):
    """The rank experiment's machinery on tiny causal / bidirectional-prefix runs: the probe runs, every causal
    matrix is exactly full rank, and the report names its checks."""
    from moe_lm.experiments.rank_probe import run_rank_probe

    prefix = ["objective.name=prefix_lm", "objective.prefix_len=16"]
    mask_claim = {"a": "bidir", "b": "causal", "metric": "loss", "expect": "not_lower", "margin": 0.01}
    definition(tmp_path, base, name="masklike", seeds=2, score_from=16, comparisons=[mask_claim],
               arms={"causal": prefix, "bidir": [*prefix, "model.attn_mask=prefix"]})  # fmt: skip
    spec = {"claim": "c", "source": "s", "probe": "rank", "arms_from": "masklike.yaml", "windows": 4,
            "probe_arms": ["causal", "bidir"]}  # fmt: skip
    (tmp_path / "ranklike.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    exp = load_experiment(str(tmp_path / "ranklike.yaml"))
    assert exp.score_from == 16 and exp.seeds == 2
    runs = run_experiment(exp, tmp_path / "runs", log=lambda s: None)
    results = run_rank_probe(exp, runs, tmp_path / "reports" / "ranklike")
    exact, numeric, at_1e6, trained = results["checks"][:4]
    assert exact["verdict"] == "true by construction" and exact["role"] == "construction"
    assert numeric["role"] == "claim" and at_1e6["role"] == "context" and trained["role"] == "claim"
    # the numerical verdict against a direct count: every causal matrix's singular values >= n * eps * s_1
    causal = next(r for r in runs if r.arm == "causal" and r.seed == 0)
    probed = next(m for m in results["models"] if m["arm"] == "causal" and m["seed"] == 0 and m["state"] == "trained")
    shares = [layer["full/numerically_full_rank_share"] for layer in probed["layers"].values()]
    assert shares == numerically_full_rank_shares(causal, windows=4)
    # the mask verdict is read off these runs: the same comparison the source experiment's report computes
    source = write_report(load_experiment(str(tmp_path / "masklike.yaml")), runs, tmp_path / "m", n_boot=10)
    assert results["mask_comparison"]["mean"] == pytest.approx(source["comparisons"][0]["mean"], rel=1e-12)
    assert results["mask_comparison"]["verdict"] == source["comparisons"][0]["verdict"]
    assert len(trained["window_bootstrap"]) == 2 and len(trained["deltas"]) == 2
    model_entry = results["models"][0]
    assert set(model_entry["attention_only_residual"]) == set(model_entry["residual"])
    assert all(layer["logits_prefix/rank_eps"]["mean"] <= 16 for layer in model_entry["layers"].values())
    assert {m["state"] for m in results["models"]} == {"trained", "untrained"}
    untrained_bidir = next(m for m in results["models"] if m["arm"] == "bidir" and m["state"] == "untrained")
    assert untrained_bidir["layers"][0]["prefix/erank"]["mean"] < 2.0  # near-uniform at initialisation
    assert "## Checks" in (tmp_path / "reports" / "ranklike" / "report.md").read_text()


def numerically_full_rank_shares(run, windows: int) -> list[float]:
    """Per layer, the share of the run's causal attention matrices whose singular values are all >= n * eps * s_1,
    by numpy's SVD of matrices rebuilt from the captured q and k."""
    _, model, _ = load_model(run.folder)
    store = []
    with torch.no_grad(), capture_attention(model, store):
        model(probe_windows(run.cfg, windows)[:, :-1])
    shares = []
    for q, k, _, mask, scale, gqa in store:
        A = attention_matrices(q, k, mask, scale, gqa).numpy()
        n = A.shape[-1]
        s = np.linalg.svd(A.reshape(-1, n, n), compute_uv=False)
        shares.append(float(np.mean((s >= n * np.finfo(np.float64).eps * s[:, :1]).all(1))))
    return shares


def test_final_evaluation_of_a_masked_language_model(tiny_data, tmp_path, train):
    """An MLM run is scored on its masked tokens, with the masks its objective fixes per window."""
    import dataclasses

    from moe_lm.train.objective import IGNORE, objective_for
    from tests.helpers.runs import with_train

    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=2)
    cfg = with_train(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attn_mask="bidirectional")),
                     objective="mlm")  # fmt: skip
    train(cfg)
    result = evaluate_run(tmp_path / "run")
    _, model, _ = load_model(tmp_path / "run")
    shard = load_split(cfg.data.out_dir, "val")
    objective, nll, n = objective_for(cfg), 0.0, 0
    with torch.no_grad():
        for d in range(shard.n_docs):
            for w in document_windows(np.asarray(shard.document(d)), cfg.train.seq_len):
                if len(w) < 2:
                    continue
                out, labels = objective.run(model, torch.from_numpy(w.astype(np.int64))[None])
                nll += F.cross_entropy(out.logits[0], labels[0], ignore_index=IGNORE, reduction="sum").item()
                n += int((labels != IGNORE).sum())
    assert result["labels"] == n and result["loss"] == pytest.approx(nll / n, rel=1e-5)
    # the attention-rank measure reads the probe windows as the objective does (masked), trained and untrained
    from moe_lm.experiments.attention_probe import erank_by_layer
    from moe_lm.experiments.measures import RANK_WINDOWS
    from moe_lm.model import initial_model

    ranked = evaluate_run(tmp_path / "run", measures=("attention_rank",))["attention_rank"]
    probe = probe_windows(cfg, RANK_WINDOWS)
    assert ranked["windows"] == len(probe) and len(ranked["erank"]) == cfg.model.n_layers
    want = erank_by_layer(model, probe, forward=lambda c: objective.run(model, c))
    assert ranked["erank"] == pytest.approx(want, rel=1e-9)
    untrained = initial_model(cfg).eval()
    want = erank_by_layer(untrained, probe, forward=lambda c: objective.run(untrained, c))
    assert ranked["erank_init"] == pytest.approx(want)
    assert max(ranked["erank_init"]) < 2.0  # untrained bidirectional attention is near-uniform: rank near one


def test_a_confirmatory_round_runs_its_declared_seeds_and_refuses_any_deviation(
    base, tmp_path, monkeypatch, cli, process
):
    import dataclasses

    from moe_lm.experiments import declaration, spec

    defs = tmp_path / "experiments"
    (defs / "confirmatory").mkdir(parents=True)
    path = definition(defs, base, name="exp")
    exp = load_experiment(path)
    declared = {
        "experiment": "exp", "definition_sha256": declaration.definition_hash(Path(path)), "arms": list(exp.arms),
        "comparisons": [dataclasses.asdict(c) for c in exp.comparisons], "first_seed": 100, "seeds": 2, "steps": 3,
        "schedule": "as the pilot", "power": {}, "declared": "2026-11-27",
    }  # fmt: skip
    (defs / "confirmatory" / "exp.yaml").write_text(yaml.safe_dump(declared, sort_keys=False))
    monkeypatch.setattr(spec, "EXPERIMENTS_DIR", defs)
    monkeypatch.setattr(declaration, "DECLARATIONS_DIR", defs / "confirmatory")
    runs, out = tmp_path / "runs", tmp_path / "report"
    for flags in (["--seeds", "3"], ["--steps", "5"], ["--extended"]):
        proc = cli("experiment", "exp", "--confirm", *flags, "--runs", runs, "--out", out)
        assert proc.returncode == 2 and "--confirm runs the declared design" in proc.stderr, proc.stderr[-2000:]
    proc = cli("experiment", "exp", "--confirm", "--runs", runs, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["confirmatory"].endswith("confirmatory/exp.yaml") and not results["exploratory"]
    assert results["comparisons"][0]["seeds"] == [100, 101] and results["verdict"] != "exploratory (no verdict)"
    assert "**Confirmatory round**" in (out / "report.md").read_text()
    assert "--confirm" in results["command"]
    assert (
        results["declaration"]["sha256"]
        == hashlib.sha256((defs / "confirmatory" / "exp.yaml").read_bytes()).hexdigest()
    )
    # outside a git checkout, the first run recorded the declaration's hash: an edit since (2 seeds -> 3, the
    # margin widened with the hashes rewritten, ...) is refused, however consistent the edited file is
    edited = {**declared, "seeds": 3}
    (defs / "confirmatory" / "exp.yaml").write_text(yaml.safe_dump(edited, sort_keys=False))
    proc = cli("experiment", "exp", "--confirm", "--runs", runs, "--out", tmp_path / "edited")
    assert proc.returncode == 2 and "changed since its first confirmatory run recorded it" in proc.stderr, proc.stderr
    # fields of the wrong type are one line naming the field, not a TypeError or StopIteration
    for field, value, said in (("first_seed", 100.5, "first_seed is 100.5"), ("seeds", 0, "seeds is 0"),
                               ("arms", "k1", "arms is 'k1'"), ("steps", True, "steps is True")):  # fmt: skip
        (defs / "confirmatory" / "exp.yaml").write_text(yaml.safe_dump({**declared, field: value}, sort_keys=False))
        proc = cli("experiment", "exp", "--confirm", "--runs", runs, "--out", tmp_path / "typed")
        assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    (defs / "confirmatory" / "exp.yaml").write_text(yaml.safe_dump(declared, sort_keys=False))
    # the definition changed after the declaration: no confirmatory verdict
    Path(path).write_text(Path(path).read_text().replace("expect: lower", "expect: higher"))
    proc = cli("experiment", "exp", "--confirm", "--runs", runs, "--out", tmp_path / "again")
    assert proc.returncode == 2 and "no confirmatory verdict" in proc.stderr and "changed since" in proc.stderr


def test_a_declaration_is_the_file_as_first_committed(tmp_path, process, monkeypatch):
    """In a git checkout a declaration is fixed by the commit that added it: an uncommitted one is not a declaration
    yet, and an edit after it (committed or not) is refused naming that commit."""
    from moe_lm.experiments import declaration
    from moe_lm.experiments.declaration import load_declaration, provenance

    repo = tmp_path / "repo"
    folder = repo / "confirmatory"
    folder.mkdir(parents=True)
    declared = {
        "experiment": "exp", "definition_sha256": "0" * 64, "arms": ["a", "b"], "comparisons": [], "first_seed": 100,
        "seeds": 6, "steps": 360, "schedule": "as the pilot", "power": {}, "declared": "2026-11-28",
    }  # fmt: skip
    (folder / "exp.yaml").write_text(yaml.safe_dump(declared, sort_keys=False))
    monkeypatch.setattr(declaration, "DECLARATIONS_DIR", folder)

    def git(*args):
        done = process.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo)
        assert done.returncode == 0, done.stderr

    git("init", "-q")
    with pytest.raises(ConfigError, match="is not committed"):
        provenance(load_declaration("exp"), tmp_path / "runs")
    git("add", "confirmatory/exp.yaml")
    git("commit", "-q", "-m", "declare")
    fixed = provenance(load_declaration("exp"), tmp_path / "runs")
    assert len(fixed["committed_in"]) == 40 and fixed["checked_against"] == "its first commit"
    (folder / "exp.yaml").write_text(yaml.safe_dump({**declared, "seeds": 2}, sort_keys=False))
    with pytest.raises(ConfigError, match=f"changed since it was first committed \\({fixed['committed_in'][:10]}\\)"):
        provenance(load_declaration("exp"), tmp_path / "runs")
    git("commit", "-q", "-am", "fewer seeds")  # committing the edit does not make it the declaration
    with pytest.raises(ConfigError, match="changed since it was first committed"):
        provenance(load_declaration("exp"), tmp_path / "runs")
    assert not (tmp_path / "runs").exists()  # a checkout records nothing: git holds what was declared
