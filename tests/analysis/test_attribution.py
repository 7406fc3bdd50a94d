"""Drift split into routing and weights (moe_lm/analysis/attribution.py, routes forced by moe_lm/routing/forced.py):
a copy with the reference's weights attributes nothing to weights; one whose router alone was moved attributes the
whole change to routing, with no interaction; one whose experts moved has a weights part."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moe_lm.analysis.attribution import drift_attribution, window_passes
from moe_lm.cli.analyze import weights_in_architecture
from moe_lm.model import Transformer
from moe_lm.routing.forced import decoder_routes, forced_routes
from moe_lm.testing import tiny_model_cfg
from tests.helpers.released import qwen3_moe


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    ref = Transformer(tiny_model_cfg()).eval()

    def copy(change=None):
        other = Transformer(tiny_model_cfg()).eval()
        other.load_state_dict(ref.state_dict())
        if change:
            with torch.no_grad():
                change(other)
        return other

    gen = torch.Generator().manual_seed(1)
    moved_router = copy(lambda m: [r.e_score_correction_bias.normal_(0.0, 0.05, generator=gen) for r in m.routers()])
    moved_experts = copy(lambda m: [p.add_(torch.randn(p.shape, generator=gen) * 0.05)
                                    for n, p in m.named_parameters() if ".experts." in n])  # fmt: skip
    docs = [(i % 2, torch.randint(2, 97, (n,), generator=gen).numpy()) for i, n in enumerate([40, 70, 25, 90, 60])]
    return ref, copy(), moved_router, moved_experts, docs


def test_forcing_a_models_own_routes_changes_nothing_and_forcing_others_changes_its_experts(models):
    ref, _, moved, _, docs = models
    t = torch.as_tensor(docs[1][1][:32])[None]
    with torch.no_grad(), decoder_routes(ref) as recorded:
        plain = ref(t).logits
    own = dict(recorded.last)
    with torch.no_grad(), forced_routes(ref, own):
        assert torch.equal(ref(t).logits, plain)
    with torch.no_grad(), decoder_routes(moved) as recorded:
        moved(t)
    theirs = dict(recorded.last)
    assert any(not torch.equal(own[layer][0], theirs[layer][0]) for layer in own)  # the moved bias moved choices
    with torch.no_grad(), forced_routes(ref, theirs), decoder_routes(ref) as recorded:
        ref(t)
    assert all(torch.equal(recorded.last[layer][0], theirs[layer][0]) for layer in theirs)


def test_equal_weights_attribute_nothing(models):
    ref, same, _, _, docs = models
    passes = window_passes(ref, same, docs[0][1][:32])
    assert not passes.pop("elsewhere").any()
    for name, values in passes.items():
        np.testing.assert_array_equal(values, passes["RR"], err_msg=name)
    split = drift_attribution(ref, same, docs, ["a", "b"], seq_len=32, n_boot=50)["all"]
    assert all(split[p]["mean"] == 0.0 for p in ("total", "weights", "routing", "interaction", "abs_total"))


def test_a_moved_router_is_routing_only(models):
    """Only the selection bias moved: with the reference's routes the copy computes exactly what the reference does
    (weights part 0), and the reference with the copy's routes computes exactly what the copy does (no
    interaction); replaying experts alone replays everything (the gate weights come from the same scores)."""
    ref, _, moved, _, docs = models
    result = drift_attribution(ref, moved, docs, ["a", "b"], seq_len=32, n_boot=50)
    split = result["all"]
    assert split["weights"]["mean"] == 0.0 and split["interaction"]["mean"] == 0.0
    assert split["abs_after_replay"]["mean"] == 0.0 and split["abs_after_experts_only_replay"]["mean"] == 0.0
    assert split["abs_total"]["mean"] > 0 and split["routing"]["mean"] == pytest.approx(split["total"]["mean"])
    assert 0 < split["routed_elsewhere"]["mean"] < 1
    assert set(result["by_domain"]) == {"a", "b"}
    assert set(split["routing_by_layer"]) == {str(i) for i in ref.moe_layer_ids()}
    lo, hi = split["abs_total"]["interval"]
    assert lo <= split["abs_total"]["mean"] <= hi


def test_moved_experts_have_a_weights_part(models):
    ref, _, _, moved, docs = models
    split = drift_attribution(ref, moved, docs, ["a", "b"], seq_len=32, n_boot=50)["all"]
    assert split["abs_after_replay"]["mean"] > 0
    parts = sum(split[p]["mean"] for p in ("weights", "routing", "interaction"))
    assert parts == pytest.approx(split["total"]["mean"], abs=1e-12)


def test_a_gguf_files_weights_come_back_into_the_run_and_their_drift_splits(tiny_run, cli, tmp_path):
    """moe_lm/interop/gguf_weights.py: an f32 GGUF export read back (dequantised by gguf-py, the exporter's tensor
    map inverted) is the run, weight for weight; a q8_0 one differs, and its drift's parts add up to its total."""
    from moe_lm.checkpoint.format import load_model
    from moe_lm.interop.gguf_weights import model_from_gguf

    cfg, run_model, _ = load_model(tiny_run, None)
    run_model.eval()
    for kind in ("f32", "q8_0"):
        proc = cli("export", "--run", tiny_run, "--gguf", tmp_path / f"{kind}.gguf", "--gguf-type", kind)
        assert proc.returncode == 0, proc.stderr[-2000:]
    ours = run_model.state_dict()
    back = model_from_gguf(tmp_path / "f32.gguf", cfg.model).state_dict()
    assert all(torch.equal(ours[k].float(), back[k].float()) for k in ours)
    q8 = model_from_gguf(tmp_path / "q8_0.gguf", cfg.model)
    gap = max(float((ours[k].float() - v.float()).abs().max()) for k, v in q8.state_dict().items() if v.numel())
    assert 0 < gap < 0.05
    docs = [(0, torch.randint(2, cfg.model.vocab_size, (48,), generator=torch.Generator().manual_seed(i)).numpy())
            for i in range(4)]  # fmt: skip
    split = drift_attribution(run_model, q8, docs, ["d"], seq_len=32, n_boot=50)["all"]
    parts = sum(split[p]["mean"] for p in ("weights", "routing", "interaction"))
    assert split["abs_total"]["mean"] > 0 and parts == pytest.approx(split["total"]["mean"], abs=1e-12)


def test_analyze_attribute_writes_the_split_for_each_quantised_type(tiny_run, cli, tmp_path):
    out = tmp_path / "drift"
    proc = cli("analyze", "--run", tiny_run, "--quantise", "q8_0", "--attribute", "--max-tokens", "600",
               "--no-init-baseline", "--out", out)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "attribution.json").read_text())["q8_0"]
    parts = sum(result["all"][p]["mean"] for p in ("weights", "routing", "interaction"))
    assert parts == pytest.approx(result["all"]["total"]["mean"], abs=1e-12)
    assert "| q8_0 |" in (out / "attribution.md").read_text() and "| q8_0 |" in proc.stdout
    assert not (out / "quantised").exists()
    proc = cli("analyze", "--run", tiny_run, "--attribute", "--out", tmp_path / "x")
    assert proc.returncode == 2 and "give --run RUN and --quantise TYPE" in proc.stderr


def test_analyze_attribute_splits_the_drift_of_compared_checkpoints_of_the_runs_architecture(tiny_run, cli, tmp_path):
    """--attribute with --compare: an earlier checkpoint of the run (router and experts both moved) splits into parts
    that add up; the run's own transformers export (imported back: the same weights) attributes nothing; the run in
    bfloat16 (--attribute-dtype, which implies --attribute) has a weights part; another architecture is not split."""
    assert cli("export", "--run", tiny_run, "--out", tmp_path / "hf").returncode == 0
    earlier, out = f"{tiny_run}:step_00000002", tmp_path / "drift"
    proc = cli("analyze", "--run", tiny_run, "--compare", earlier, tmp_path / "hf", "--attribute-dtype", "bfloat16",
               "--max-tokens", "600", "--no-init-baseline", "--out", out)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "attribution.json").read_text())
    moved = result[earlier]["all"]
    assert moved["abs_total"]["mean"] > 0 and moved["routed_elsewhere"]["mean"] > 0
    parts = sum(moved[p]["mean"] for p in ("weights", "routing", "interaction"))
    assert parts == pytest.approx(moved["total"]["mean"], abs=1e-12)
    same = result[str(tmp_path / "hf")]["all"]
    assert all(same[p]["mean"] == 0.0 for p in ("total", "weights", "routing", "interaction", "abs_total"))
    assert same["routed_elsewhere"]["mean"] == 0.0
    bf16 = result[f"{tiny_run} in bfloat16"]["all"]  # the run itself in bfloat16: weights and arithmetic rounded
    assert bf16["abs_total"]["mean"] > 0 and bf16["abs_after_replay"]["mean"] > 0
    parts = sum(bf16[p]["mean"] for p in ("weights", "routing", "interaction"))
    assert parts == pytest.approx(bf16["total"]["mean"], abs=1e-12)
    qwen3_moe().save_pretrained(tmp_path / "qwen")  # another architecture: its routes cannot be forced into the run
    assert weights_in_architecture(str(tmp_path / "qwen")) is None and weights_in_architecture(earlier) is not None
