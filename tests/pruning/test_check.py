"""`moe-lm prune --check` against its definitions: the per-domain log-prob change of a pruned model on the held-out
windows, its document-bootstrap interval, random's seeds, the Spearman agreement with ablation, and the command end
to end (its three files; bad input one line, exit 2)."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import scipy.stats
import torch
import torch.nn.functional as F

import moe_lm.pruning.checked as checked_model
from moe_lm.analysis.ablation import document_losses
from moe_lm.analysis.subjects.loaded import OwnDocuments
from moe_lm.checkpoint.format import load_model
from moe_lm.data.prepare import load_split
from moe_lm.pruning.check import arm_result, held_out_pass, spearman, spearman_by_layer
from moe_lm.pruning.plan import KeepPlan
from moe_lm.pruning.pruned import pruned_model
from moe_lm.routing.torch_routing import transformer_routing

CRITERIA, KEEPS = ("random", "ablation"), (12, 8)


@pytest.fixture(scope="module")
def checked(grouped_run, tmp_path_factory, cli):
    """The check of the shared grouped run: random (2 seeds) and ablation at 25 % and 50 %, every validation
    document held out, the calibration the training split under 300 tokens."""
    out = tmp_path_factory.mktemp("check") / "check"
    proc = cli("prune", "--run", grouped_run, "--check", "--criteria", *CRITERIA, "--sparsities", "0.25", "0.5",
               "--random-seeds", "2", "--max-tokens", "300", "--held-out-tokens", "100000", "--batch-size", "64",
               "--out", out)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "check.json").read_text())


def direct_logprobs(model, docs, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Per document the summed log p(next token) over its windows of seq_len, and the count: every window a row of
    one right-padded batch (causal: the padding after a window reaches none of its tokens)."""
    windows = [(i, np.asarray(tokens[s : s + seq_len], np.int64)) for i, (_, tokens) in enumerate(docs)
               for s in range(0, len(tokens), seq_len) if len(tokens[s : s + seq_len]) > 1]  # fmt: skip
    batch = torch.zeros(len(windows), seq_len, dtype=torch.long)
    for row, (_, w) in enumerate(windows):
        batch[row, : len(w)] = torch.from_numpy(w)
    with torch.no_grad():
        logp = F.log_softmax(model(batch).logits.double(), -1)
    total, count = np.zeros(len(docs)), np.zeros(len(docs))
    for row, (i, w) in enumerate(windows):
        total[i] += logp[row, : len(w) - 1].gather(1, torch.from_numpy(w[1:, None])).sum().item()
        count[i] += len(w) - 1
    return total, count


def test_the_delta_of_an_arm_is_the_pruned_minus_the_unpruned_log_prob_per_token(grouped_run, checked):
    """(a) ablation keeping 8: the check's per-domain Δ from the model's own log-probs, window by window."""
    _, record = checked
    cfg, model, _ = load_model(grouped_run)
    shard = load_split(cfg.data.out_dir, "val")
    docs = [(int(shard.doc_domain[d]), np.asarray(shard.document(d))) for d in range(shard.n_docs)]
    assert record["held_out"]["n_documents"] == len(docs) and record["held_out"]["documents"].endswith(
        "(validation split)"
    )
    scores = {int(layer): np.array(v) for layer, v in record["scores"]["ablation"].items()}
    plan = KeepPlan.from_scores(scores, 8, 4)
    base, n = direct_logprobs(model, docs, 32)
    pruned, _ = direct_logprobs(pruned_model(model, cfg, plan), docs, 32)
    arm = next(a for a in record["arms"] if a["criterion"] == "ablation" and a["n_keep"] == 8)
    domain = np.array([d for d, _ in docs])
    for d, name in enumerate(shard.domains):
        expected = (pruned[domain == d] - base[domain == d]).sum() / n[domain == d].sum()
        assert arm["by_domain"][name]["delta"] == pytest.approx(expected, abs=2e-5), name
    assert any(abs(v["delta"]) > 1e-3 for v in arm["by_domain"].values())  # the pruning changed something
    # the pass's per-document losses are ablation.py's document_losses
    loss, count = document_losses(lambda t: model(t).logits, docs, 32, batch=200)
    got = held_out_pass(transformer_routing(model), docs, 32, batch_size=200)
    np.testing.assert_allclose(got.loss, loss, rtol=1e-5)
    np.testing.assert_array_equal(got.count, count)
    assert len(got.experts[1]) == count.sum() and got.experts[1].shape[1] == 2


def test_intervals_hold_their_estimates_and_randoms_seeds_differ(grouped_run, checked):
    """(b) every interval holds its Δ; random's two seeds are two plans with two different Δ, their mean reported."""
    _, record = checked
    for arm in record["arms"]:
        for v in arm["by_domain"].values():
            assert v["ci95"][0] <= v["delta"] <= v["ci95"][1] and v["documents"] > 0
        for layer in arm["routing"].values():
            assert layer["max_over_mean"] == pytest.approx(layer["maxvio"] + 1) and 0 <= layer["top1_changed"] <= 1
    assert record["scores"]["random (seed 0)"] != record["scores"]["random (seed 1)"]
    random = next(a for a in record["arms"] if a["criterion"] == "random" and a["n_keep"] == 8)
    assert random["seeds"] == [0, 1] and len(random["per_seed"]) == 2
    for name, v in random["by_domain"].items():
        each = [s["by_domain"][name]["delta"] for s in random["per_seed"]]
        assert each[0] != each[1] and v["delta"] == pytest.approx(np.mean(each), abs=1e-12)
        assert v["seeds_sd"] == pytest.approx(np.std(each, ddof=1))


def test_an_arms_interval_is_a_bootstrap_over_documents():
    """(b) on a model of its own: the interval holds the estimate and narrows to it when every document agrees."""
    cfg, model = _grouped_model()
    rng = np.random.default_rng(0)
    docs = [(i % 2, rng.integers(0, 97, 40)) for i in range(8)]
    plan = KeepPlan.from_scores({layer: rng.random(16) for layer in (1, 2)}, 8, 4)
    base = held_out_pass(transformer_routing(model), docs, 16)
    arm = held_out_pass(transformer_routing(pruned_model(model, cfg, plan)), docs, 16)
    result = arm_result(base, arm, plan, np.array([d for d, _ in docs]), ["a", "b"], n_boot=200)
    for v in result["by_domain"].values():
        assert v["ci95"][0] <= v["delta"] <= v["ci95"][1] and v["ci95"][0] < v["ci95"][1] and v["documents"] == 4
    same = arm_result(arm, arm, plan, np.array([d for d, _ in docs]), ["a", "b"], n_boot=200)
    assert all(v["delta"] == 0 and v["ci95"] == [0, 0] for v in same["by_domain"].values())


def _grouped_model():
    from moe_lm.config import Config, TrainConfig
    from moe_lm.model import Transformer
    from moe_lm.testing import tiny_model_cfg

    cfg = Config(
        model=tiny_model_cfg(moe=dict(n_routed_experts=16, n_group=4, topk_group=2)), train=TrainConfig(seq_len=32)
    )
    model = Transformer(cfg.model).eval()
    with torch.no_grad():
        for router in model.routers():
            router.weight.mul_(20)
    return cfg, model


def test_spearman_with_ablation_is_the_rank_correlation(checked):
    """(c) ablation against itself is 1 in every layer; a criterion's ρ is scipy's; ties take their mean rank."""
    _, record = checked
    agreement = record["spearman_with_ablation"]
    reference = record["scores"]["ablation"]
    assert all(v == pytest.approx(1.0) for v in agreement["ablation"].values())
    for name in ("random (seed 0)", "random (seed 1)"):
        for layer, rho in agreement[name].items():
            if layer != "mean":
                expected = scipy.stats.spearmanr(record["scores"][name][layer], reference[layer]).statistic
                assert rho == pytest.approx(expected, abs=1e-12)
    assert record["tracks_ablation_best"] == "random"  # the only other criterion checked
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 5, 16).astype(float), rng.random(16)  # ties in a
    assert spearman(a, b) == pytest.approx(scipy.stats.spearmanr(a, b).statistic, abs=1e-12)
    assert spearman_by_layer({3: a}, {3: a}) == {"3": pytest.approx(1.0), "mean": pytest.approx(1.0)}
    assert np.isnan(spearman(np.ones(16), b))


def test_the_command_writes_its_table_report_and_figure(checked):
    """(d) check.json, check.md with a row per criterion x sparsity x domain, check.png."""
    out, record = checked
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "calibration_trace", "check.json", "check.md", "check.png"]  # fmt: skip
    assert (out / "check.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    domains = record["held_out"]["domains"]
    table = (out / "check.md").read_text().split("## Routing")[0]
    rows = [line for line in table.splitlines() if re.match(r"\| (random|ablation) \|", line)]
    assert len(rows) == len(CRITERIA) * len(KEEPS) * len(domains) == 12
    assert {(a["criterion"], a["n_keep"]) for a in record["arms"]} == {(c, k) for c in CRITERIA for k in KEEPS}
    assert record["calibration"]["documents"].endswith("(training split)")


def check_from_trace(cli, run, checked, out, *flags) -> dict:
    """`prune --check` of `run` scored from the shared check's calibration trace, into `out`: its check.json."""
    proc = cli("prune", "--run", run, "--check", "--trace", checked[0] / "calibration_trace", "--batch-size", "64",
               "--out", out, *flags)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "check.json").read_text())


def test_ungrouped_arms_and_what_dropping_the_groups_alone_costs(grouped_run, checked, tmp_path, cli):
    """--ungroup: 7 of 16 kept (no equal share of the 4 groups) by frequency over each whole layer; the arm that
    drops the groups and removes nothing, and the pruned arm, each against a model built here: the source's weights
    routed without groups (n_group 1), the removed experts' bias at -inf."""
    import dataclasses

    from moe_lm.model import Transformer

    record = check_from_trace(cli, grouped_run, checked, tmp_path / "ungrouped", "--criteria", "frequency", "--keeps",
                              "7", "--ungroup", "--held-out-tokens", "100000")  # fmt: skip
    assert record["ungrouped"] == {"n_group": 4, "topk_group": 2}
    assert [(a["criterion"], a["n_keep"]) for a in record["arms"]] == [("none, groups dropped", 16), ("frequency", 7)]
    assert "dropping the groups alone costs" in (tmp_path / "ungrouped" / "check.md").read_text()
    cfg, model, _ = load_model(grouped_run)
    shard = load_split(cfg.data.out_dir, "val")
    docs = [(int(shard.doc_domain[d]), np.asarray(shard.document(d))) for d in range(shard.n_docs)]
    domain = np.array([d for d, _ in docs])
    base, n = direct_logprobs(model, docs, 32)
    frequency = np.array(record["scores"]["frequency"]["1"])
    kept = sorted(np.lexsort((np.arange(16), -frequency))[:7].tolist())  # the 7 most chosen, ties to the lower id
    for arm, removed in zip(record["arms"], ([], [e for e in range(16) if e not in kept]), strict=True):
        moe = dataclasses.replace(cfg.model.moe, n_group=1, topk_group=1)
        reference = Transformer(dataclasses.replace(cfg.model, moe=moe)).eval()
        reference.load_state_dict(model.state_dict())
        with torch.no_grad():
            reference.layers[1].mlp.gate.e_score_correction_bias[removed] = float("-inf")
        got, _ = direct_logprobs(reference, docs, 32)
        for d, name in enumerate(shard.domains):
            expected = (got[domain == d] - base[domain == d]).sum() / n[domain == d].sum()
            assert arm["by_domain"][name]["delta"] == pytest.approx(expected, abs=2e-5), (arm["criterion"], name)
    assert any(v["top1_changed"] > 0 for v in record["arms"][0]["routing"].values())  # the groups mattered


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sparsities", "0.25", "1"], "--sparsities 1: each must be a fraction between 0 and 1"),
        (["--sparsities", "0.5", "--criteria", "reap", "magic"], "--criteria magic: not a criterion"),
        (["--keeps", "10"], "cannot share equally.*or keep 10 with --ungroup"),
        (["--sparsities", "0.5", "--no-held-out"], "no held-out documents"),
    ],
)
def test_bad_input_is_one_line_exit_2(grouped_run, tmp_path, cli, monkeypatch, flags, message):
    if "--no-held-out" in flags:
        flags = [f for f in flags if f != "--no-held-out"]
        empty = OwnDocuments("nothing (validation split)", lambda: (iter([]), ["cooking"]))
        monkeypatch.setattr(checked_model, "validation_split", lambda cfg: empty)
    out = tmp_path / "out"
    proc = cli("prune", "--run", grouped_run, "--check", "--out", out, "--max-tokens", "300", *flags)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert re.search(message, proc.stderr) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not out.exists()


def test_a_trace_is_reused_and_one_of_the_held_out_documents_refused(grouped_run, checked, tmp_path, cli):
    """--trace scores from a recorded trace (nothing recorded again; without ablation, no Spearman); a trace recorded
    on the validation split, the held-out documents, is refused."""
    out, _ = checked
    record = check_from_trace(cli, grouped_run, checked, tmp_path / "again", "--criteria", "frequency", "gate-mass",
                              "--keeps", "8", "--held-out-tokens", "600")  # fmt: skip
    assert not (tmp_path / "again" / "calibration_trace").exists() and record["spearman_with_ablation"] is None
    assert [(a["criterion"], a["n_keep"]) for a in record["arms"]] == [("frequency", 8), ("gate-mass", 8)]
    assert "Not measured" in (tmp_path / "again" / "check.md").read_text()
    held_out = tmp_path / "held_out_trace"
    shutil.copytree(out / "calibration_trace", held_out)
    meta = json.loads((held_out / "meta.json").read_text())
    meta["provenance"]["data"] = meta["provenance"]["data"].replace("(training split)", "(validation split)")
    (held_out / "meta.json").write_text(json.dumps(meta))
    proc = cli("prune", "--run", grouped_run, "--check", "--keeps", "8", "--trace", held_out, "--out", tmp_path / "x")
    assert proc.returncode == 2 and "recorded on the held-out documents" in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()
