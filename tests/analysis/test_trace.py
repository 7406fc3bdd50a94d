"""The recorder stores exactly what the router chose; `moe-lm analyze` (launch/analyze_routing.py) produces the
whole report."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import moe_lm.experiments.variants  # noqa: F401  (registers the research variants used below)
from moe_lm.analysis import metrics as M
from moe_lm.analysis.recording import record_trace
from moe_lm.model import Transformer
from moe_lm.model.router import gate_weights, select_experts
from moe_lm.routing.torch_routing import transformer_routing
from moe_lm.routing.trace import Trace
from moe_lm.testing import replace_moe, tiny_model_cfg
from tests.helpers.runs import tiny_train_cfg


def analyze(cli, *args):
    """`moe-lm analyze args...`, which must succeed."""
    proc = cli("analyze", *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def biased_grouped_model():
    cfg = replace_moe(tiny_model_cfg(), n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for r in model.routers():
            r.e_score_correction_bias.normal_(0.0, 0.1)
    return model


def test_trace_holds_exactly_the_routers_decisions(tmp_path):
    model = biased_grouped_model()
    gen = torch.Generator().manual_seed(0)
    docs = [(i % 2, torch.randint(2, 97, (n,), generator=gen).numpy()) for i, n in enumerate([5, 40, 17, 70, 3])]
    trace = record_trace(transformer_routing(model), docs, tmp_path / "trace", ["a", "b"], seq_len=32, batch_size=3,
                         progress=False)  # fmt: skip
    assert trace.n == sum(len(t) for _, t in docs) and trace.meta["n_docs"] == 5
    assert trace.experts(1).dtype == np.uint8 and trace.weights(1).dtype == np.float16
    # reference: each document chunk alone (no padding), the router's inputs captured, its maths called directly
    inputs = {}
    hooks = [
        moe.gate.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
        for i, moe in zip(trace.layers, model.moe_layers(), strict=True)
    ]
    row = 0
    for d, (domain, tokens) in enumerate(docs):
        for start in range(0, len(tokens), 32):
            chunk = torch.from_numpy(tokens[start : start + 32].astype(np.int64))[None]
            with torch.no_grad():
                model(chunk)
            rows = slice(row, row + chunk.shape[1])
            assert (trace.doc[rows] == d).all() and (trace.domain[rows] == domain).all()
            assert np.array_equal(trace.pos[rows], np.arange(start, start + chunk.shape[1]))
            assert np.array_equal(trace.token[rows], chunk[0].numpy())
            for layer, moe in zip(trace.layers, model.moe_layers(), strict=True):
                g, c = moe.gate, moe.gate.cfg
                scores = torch.sigmoid(inputs[layer].float() @ g.weight.detach().float().T)
                idx = select_experts(scores, g.e_score_correction_bias, c.num_experts_per_tok, c.n_group, c.topk_group)
                w = gate_weights(scores, idx, c.norm_topk_prob, c.routed_scaling_factor)
                assert np.array_equal(trace.experts(layer)[rows], idx.numpy())  # same experts, same rank order
                np.testing.assert_allclose(trace.weights(layer)[rows], w.numpy(), atol=2e-3)  # fp16 storage
            row += chunk.shape[1]
    for h in hooks:
        h.remove()
    assert row == trace.n
    reopened = Trace(tmp_path / "trace")
    assert np.array_equal(reopened.experts(2), trace.experts(2))


def test_trace_streams_to_disk_without_holding_rows(tmp_path):
    model = biased_grouped_model()
    docs = ((0, np.random.default_rng(i).integers(2, 97, 60)) for i in range(50))  # a generator: nothing kept
    trace = record_trace(transformer_routing(model), docs, tmp_path / "t", ["x"], seq_len=16, batch_size=8,
                         max_tokens=1000, progress=False)  # fmt: skip
    assert 0 < trace.n <= 1000
    assert (tmp_path / "t" / "token.u32").stat().st_size == 4 * trace.n
    assert trace.meta["tokens_per_s"] > 0


def test_training_evaluation_logs_headline_routing_metrics(tiny_run):
    rows = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in rows if r["kind"] == "eval"][-1]
    for key in ("maxvio_global/layer_1", "domain_jsd/layer_1", "same_first/layer_1", "topk_overlap/layer_1"):
        assert key in ev
    assert 0 <= ev["same_first/layer_1"] <= ev["topk_overlap/layer_1"] <= 1


def test_analyze_routing_writes_every_figure_the_page_and_the_json(tiny_run, cli, tmp_path):
    out = tmp_path / "report"
    analyze(
        cli,
        "--run",
        tiny_run,
        "--out",
        out,
        "--compare",
        f"{tiny_run}:step_00000002",
        "--chart-tokens",
        "he",
        "on",
        "--min-count",
        "5",
    )
    figs = {p.name for p in (out / "figures").glob("*.png")}
    for layer in (1,):
        assert {f"domain_experts_L{layer}.png", f"relative_load_L{layer}.png", f"coactivation_L{layer}.png",
                f"saliency_L{layer}.png"} <= figs  # fmt: skip
    assert {"repetition.png", "load_over_training.png", "agreement.png"} <= figs
    assert any(name.startswith("token_") for name in figs)
    m = json.loads((out / "metrics.json").read_text())
    layer = m["layers"]["1"]
    assert set(m["trace"]["domains"]) == {"astronomy", "cooking", "finance"}
    np.testing.assert_allclose(np.array(layer["domain_token_share"]).sum(1), 2)  # shares sum to k
    assert {"same_first", "topk_overlap", "same_first_ci95"} <= set(layer["repetition"])
    assert "init_N1" in m and "maxvio_floor" in m["baseline_uniform_N0"]
    # the compared checkpoint's top-k overlap is OLMoE's router saturation of the two traces
    compared = m["comparisons"][f"{tiny_run}:step_00000002"]["layers"]["1"]
    saturation = M.saturation(Trace(out / "trace").experts(1), Trace(out / "trace_compare_0").experts(1))
    assert compared["topk_overlap"]["mean"] == pytest.approx(saturation)
    page = (out / "routing.html").read_text()
    assert '<select id="layer"' in page and page.count("class='t'") > 100 and "L1: e" in page
    assert "Most preferred tokens per expert" in page and len(layer["preferred_tokens"]) == 8
    # the tidy table: one row per layer x domain x expert, consistent with metrics.json
    import csv

    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert len(rows) == len(m["layers"]) * 3 * 8
    for d, name in enumerate(m["trace"]["domains"]):
        mine = [r for r in rows if r["layer"] == "1" and r["domain"] == name]
        assert sum(float(r["token_share"]) for r in mine) == pytest.approx(2)  # k
        assert sum(int(r["token_slots"]) for r in mine) == 2 * m["trace"]["tokens_per_domain"][d]
        assert [float(r["relative_load"]) for r in mine] == pytest.approx(layer["domain_relative_load"][d])
        assert [float(r["reap_saliency"]) for r in mine] == pytest.approx(layer["domain_saliency"][d])
    # REAP's saliency per expert and domain, against its definition: the mean gate x output norm of the (token,
    # slot) pairs that chose the expert, a loop over the trace's rows
    trace = Trace(out / "trace")
    experts, weights, norms = trace.experts(1), trace.weights(1), trace.norms(1)
    total, pairs = np.zeros((4, 8)), np.zeros((4, 8))  # row 3: every domain
    for t in range(trace.n):
        for k in range(trace.k):
            for row in (int(trace.domain[t]), 3):
                total[row, experts[t, k]] += float(weights[t, k]) * float(norms[t, k])
                pairs[row, experts[t, k]] += 1
    want = np.divide(total, pairs, out=np.zeros_like(total), where=pairs > 0)
    np.testing.assert_allclose(layer["domain_saliency"], want[:3], rtol=1e-9)
    np.testing.assert_allclose(layer["saliency"], want[3], rtol=1e-9)
    assert (pairs[3] > 0).sum() >= 6 and max(layer["saliency"]) > 0


def test_analyze_routing_on_the_users_own_files(tiny_run, cli, tmp_path):
    data = tmp_path / "mine"
    (data / "poetry").mkdir(parents=True)
    (data / "poetry" / "a.txt").write_text("the stars tracked the onion galaxy " * 30)
    (data / "notes.jsonl").write_text(json.dumps({"text": "bond yield rose " * 40, "domain": "money"}) + "\n")
    out = tmp_path / "report"
    analyze(cli, "--run", tiny_run, "--data", data / "poetry", data / "notes.jsonl", "--out", out, "--no-init-baseline")
    m = json.loads((out / "metrics.json").read_text())
    assert set(m["trace"]["domains"]) == {"poetry", "money"}


def test_prefix_models_are_refused_for_recording(tmp_path):
    cfg = dataclasses.replace(tiny_model_cfg(), attn_mask="prefix")
    with pytest.raises(ValueError, match="causal"):
        record_trace(transformer_routing(Transformer(cfg)), [(0, np.arange(5))], tmp_path / "t", ["x"], seq_len=8,
                     progress=False)  # fmt: skip


def test_analysis_is_logged_to_the_runs_wandb_when_asked(tiny_data, tmp_path, train, cli):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=2)
    cfg = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, wandb_mode="offline"))
    train(cfg)  # its own run: wandb offline is a logging setting, and the analysis writes into the run's wandb
    wandb_dir = next((tmp_path / "run" / "wandb").glob("offline-run-*"))
    before = sum(f.stat().st_size for f in wandb_dir.glob("*.wandb"))
    listing = sorted(p.relative_to(tmp_path) for p in (tmp_path / "run" / "wandb").rglob("*"))
    analyze(cli, "--run", tmp_path / "run", "--out", tmp_path / "plain", "--no-init-baseline")
    # not asked: the training run's wandb folder is left as it was
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "run" / "wandb").rglob("*")) == listing
    analyze(cli, "--run", tmp_path / "run", "--out", tmp_path / "report", "--no-init-baseline", "--wandb")
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    # the figures went to the same wandb run id (a resumed offline run), with image files
    assert all(r.name.endswith((tmp_path / "run" / "wandb_id").read_text()) for r in runs)
    assert sum(f.stat().st_size for r in runs for f in r.glob("*.wandb")) > before
    assert list((tmp_path / "run" / "wandb").rglob("*.png"))


def test_analyze_routing_errors_name_the_problem(tiny_run, cli, tmp_path):
    def fails(*args) -> str:
        proc = cli("analyze", *args)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        return proc.stderr

    assert "not found: nowhere.txt" in fails("--run", tiny_run, "--out", tmp_path / "a", "--data", "nowhere.txt")
    (tmp_path / "empty.jsonl").write_text("")
    assert "no tokens to analyse" in fails(
        "--run", tiny_run, "--out", tmp_path / "b", "--data", tmp_path / "empty.jsonl"
    )
    listed = fails("--run", f"{tiny_run}:step_09", "--out", tmp_path / "c")
    assert "not a complete checkpoint" in listed and "step_00000002" in listed
    assert f"compared subject {tiny_run}:nope" in fails("--run", tiny_run, "--compare", f"{tiny_run}:nope", "--out",
                                                       tmp_path / "d")  # fmt: skip


def test_a_trace_written_layer_by_layer_equals_one_written_row_by_row(tmp_path):
    """The writer's two orders (rows of every layer as a forward pass gives them, or one layer's column for every
    token as a layer-by-layer pass gives them) write the same files."""
    from moe_lm.routing.trace import TraceWriter

    model = biased_grouped_model()
    docs = [(i % 2, np.arange(2, 2 + n) % 97) for i, n in enumerate([30, 50, 9])]
    rows = record_trace(transformer_routing(model), docs, tmp_path / "rows", ["a", "b"], seq_len=16, batch_size=2,
                        progress=False)  # fmt: skip
    writer = TraceWriter(tmp_path / "layers", rows.layers, rows.n_experts, rows.k, rows.domains, rows.provenance)
    half = rows.n // 2  # the token columns in two parts, each layer in one
    for part in (slice(0, half), slice(half, rows.n)):
        writer.append_tokens(rows.token[part], rows.doc[part], rows.pos[part], rows.domain[part], rows.logprob[part])
    for layer in rows.layers:
        writer.write_layer(layer, rows.experts(layer), rows.weights(layer), rows.margins(layer), rows.norms(layer))
    layers = writer.close({"windows": 16})
    assert sorted(p.name for p in (tmp_path / "rows").iterdir()) == sorted(
        p.name for p in (tmp_path / "layers").iterdir()
    )
    for f in (tmp_path / "rows").iterdir():
        if f.name != "meta.json":
            assert f.read_bytes() == (tmp_path / "layers" / f.name).read_bytes(), f.name
    assert layers.n == rows.n and layers.columns == rows.columns
    broken = TraceWriter(tmp_path / "short", rows.layers, rows.n_experts, rows.k, rows.domains, {})
    broken.append_tokens(rows.token, rows.doc, rows.pos, rows.domain)
    with pytest.raises(ValueError, match="other row counts"):
        broken.close()
