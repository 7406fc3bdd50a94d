"""`moe-lm prune` end to end on a trained run of 16 experts in 4 groups: the pruned run loads where a run loads and
gives the source's logits under the mask, a trace is reused, and bad input is one line that leaves nothing."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from moe_lm.checkpoint.format import load_model
from moe_lm.model import Transformer
from moe_lm.pruning.plan import KeepPlan
from moe_lm.routing.trace import Trace


@pytest.fixture(scope="module")
def pruned(grouped_run, tmp_path_factory, cli):
    out = tmp_path_factory.mktemp("pruned") / "p50"
    proc = cli("prune", "--run", grouped_run, "--sparsity", "0.5", "--out", out, "--max-tokens", "1500")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kept 8 of 16 routed experts in each of 1 MoE layers (reap)" in proc.stdout
    return out


def test_the_pruned_run_gives_the_sources_logits_with_the_removed_experts_masked(grouped_run, pruned):
    plan = KeepPlan.from_json(json.loads((pruned / "prune.json").read_text()))
    assert plan.about["criterion"] == "reap" and plan.about["source"]["tag"] == "step_00000002"
    cfg, model, tag = load_model(pruned)
    _, source, _ = load_model(grouped_run)
    assert tag == "step_00000002" and cfg.model.moe.n_routed_experts == 8 and cfg.model.moe.n_group == 4
    assert cfg.train.out_dir == str(pruned)
    with torch.no_grad():
        for layer in plan.layers:
            source.layers[layer].mlp.gate.e_score_correction_bias[plan.removed(layer)] = float("-inf")
        tokens = torch.randint(0, 300, (3, 32))
        torch.testing.assert_close(model(tokens).logits, source(tokens).logits, rtol=1e-5, atol=1e-5)
    # the kept experts are each group's best by the recorded trace's REAP saliency
    trace = Trace(pruned / "calibration_trace")
    assert "norms" in trace.columns and trace.n == 1500
    w, n, e = (np.asarray(c, np.float64) for c in (trace.weights(1), trace.norms(1), trace.experts(1)))
    saliency = np.array([(w * n)[e == j].mean() if (e == j).any() else 0.0 for j in range(16)])
    np.testing.assert_allclose(plan.scores[1], saliency, rtol=1e-9)


def test_a_recorded_trace_is_reused_and_a_domain_chosen(grouped_run, pruned, tmp_path, cli):
    out = tmp_path / "f12"
    proc = cli("prune", "--run", grouped_run, "--keep", "12", "--criterion", "frequency", "--domains", "cooking",
               "--trace", pruned / "calibration_trace", "--out", out)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (out / "calibration_trace").exists() and "calibration tokens" not in proc.stdout
    plan = KeepPlan.from_json(json.loads((out / "prune.json").read_text()))
    trace = Trace(pruned / "calibration_trace")
    cooking = np.asarray(trace.domain) == trace.domains.index("cooking")
    counts = np.bincount(np.asarray(trace.experts(1))[cooking].ravel(), minlength=16)
    assert plan.scores[1] == tuple(float(c) for c in counts) and plan.about["domains"] == ["cooking"]
    assert load_model(out)[0].model.moe.n_routed_experts == 12


def test_ungroup_keeps_a_count_the_groups_cannot_share_and_routes_without_them(grouped_run, pruned, tmp_path, cli):
    """--keep 7 of 16 in 4 groups is refused, naming --ungroup; with it the pruned run routes without groups
    (n_group 1, said in prune.json and on the console) and gives the source routed so, the removed experts masked."""
    refused = cli("prune", "--run", grouped_run, "--keep", "7", "--out", tmp_path / "no")
    assert refused.returncode == 2 and "or keep 7 with --ungroup" in refused.stderr
    out = tmp_path / "u7"
    proc = cli("prune", "--run", grouped_run, "--keep", "7", "--criterion", "frequency", "--ungroup",
               "--trace", pruned / "calibration_trace", "--out", out)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "routes without expert groups (--ungroup; the source: 4 groups, the best 2 used)" in proc.stdout
    plan = KeepPlan.from_json(json.loads((out / "prune.json").read_text()))
    assert plan.n_group == 1 and plan.about["ungrouped"] == {"n_group": 4, "topk_group": 2}
    cfg, model, _ = load_model(out)
    assert (cfg.model.moe.n_routed_experts, cfg.model.moe.n_group, cfg.model.moe.topk_group) == (7, 1, 1)
    source_cfg, source, _ = load_model(grouped_run)
    moe = dataclasses.replace(source_cfg.model.moe, n_group=1, topk_group=1)
    reference = Transformer(dataclasses.replace(source_cfg.model, moe=moe)).eval()
    reference.load_state_dict(source.state_dict())
    with torch.no_grad():
        reference.layers[1].mlp.gate.e_score_correction_bias[plan.removed(1)] = float("-inf")
        tokens = torch.randint(0, 300, (3, 32), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sparsity", "0"], "--sparsity must be a fraction between 0 and 1"),
        (["--keep", "1"], "fewer than the 2 each token is routed to"),
        (["--keep", "10"], "cannot share equally.*--keep 8 \\(sparsity 0.5\\) or --keep 12"),
        (["--keep", "4"], "sum of its top-2"),
        (["--keep", "8", "--domains", "poetry"], "--domains poetry: not a domain"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(grouped_run, tmp_path, cli, flags, message):
    out = tmp_path / "out"
    proc = cli("prune", "--run", grouped_run, "--out", out, "--max-tokens", "300", *flags)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert __import__("re").search(message, proc.stderr) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_the_source_is_never_the_output(grouped_run, tmp_path, cli):
    listing = sorted(p.name for p in grouped_run.rglob("*"))
    for out in (grouped_run, grouped_run.parent):
        proc = cli("prune", "--run", grouped_run, "--out", out, "--keep", "8", "--force")
        assert proc.returncode == 2 and "is the source run or holds it" in proc.stderr
    inside = cli("prune", "--run", grouped_run, "--out", grouped_run / "p", "--keep", "8")
    assert inside.returncode == 2 and "lies inside the run folder" in inside.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    theirs = cli("prune", "--run", grouped_run, "--out", tmp_path / "mine", "--keep", "8")
    assert theirs.returncode == 2 and "did not write" in theirs.stderr
    assert sorted(p.name for p in grouped_run.rglob("*")) == listing and (tmp_path / "mine" / "notes.txt").exists()


def test_the_pruned_run_is_analysed_as_any_run_and_its_trace_has_the_norms(pruned, tmp_path, cli):
    proc = cli("analyze", "--run", pruned, "--out", tmp_path / "a", "--max-tokens", "600", "--no-init-baseline")
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = Trace(tmp_path / "a" / "trace")
    assert trace.n_experts == 8 and "norms" in trace.columns and np.isfinite(np.asarray(trace.norms(1))).all()


def test_ablation_scores_every_expert_by_the_loss_it_costs(grouped_run, tmp_path, cli):
    out = tmp_path / "abl"
    proc = cli("prune", "--run", grouped_run, "--keep", "12", "--criterion", "ablation", "--max-tokens", "300",
               "--out", out)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = KeepPlan.from_json(json.loads((out / "prune.json").read_text()))
    assert plan.about["criterion"] == "ablation" and len(plan.scores[1]) == 16
    assert all(np.isfinite(plan.scores[1])) and len(set(plan.scores[1])) > 1
