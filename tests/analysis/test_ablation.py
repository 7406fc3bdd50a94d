"""Causal expert ablation: its known answers."""

from __future__ import annotations

import json

import numpy as np
import torch

from moe_lm.analysis.ablation import ablation_study, document_losses, route_around
from moe_lm.model import Transformer
from moe_lm.routing.recorder import RoutingRecorder, routers_by_layer
from moe_lm.routing.torch_routing import transformer_routing
from moe_lm.testing import replace_moe, tiny_model_cfg


def docs(n=12, seed=0):
    rng = np.random.default_rng(seed)
    return [(i % 3, rng.integers(0, 97, int(rng.integers(20, 60)))) for i in range(n)]


def test_routed_around_experts_are_never_chosen_and_others_take_their_place():
    model = Transformer(tiny_model_cfg()).eval()
    tokens = torch.randint(0, 97, (4, 40))
    with RoutingRecorder(routers_by_layer(model)) as rec:
        model(tokens)
        before = rec.last[1][0].clone()
        with route_around(transformer_routing(model), 1, [2, 5]):
            model(tokens)
            after = rec.last[1][0]
    assert (before == 2).any() or (before == 5).any()  # the test would see a change
    assert not ((after == 2) | (after == 5)).any() and after.shape == before.shape
    assert all(len(set(row.tolist())) == 3 for row in after)  # still k distinct experts per token


def test_ablating_an_expert_that_receives_no_tokens_changes_nothing():
    model = Transformer(tiny_model_cfg()).eval()
    with torch.no_grad():
        model.layers[1].mlp.gate.e_score_correction_bias[4] = -10.0  # expert 4 is never chosen
    d = docs()
    base = document_losses(lambda t: model(t).logits, d, seq_len=32)
    with route_around(transformer_routing(model), 1, [4]):
        ablated = document_losses(lambda t: model(t).logits, d, seq_len=32)
    assert np.array_equal(base[0], ablated[0]) and np.array_equal(base[1], ablated[1])
    result = ablation_study(
        transformer_routing(model), d, ["a", "b", "c"], [(1, [4])], seq_len=32, controls=2, n_boot=200
    )
    assert all(v["delta"] == 0.0 for v in result["ablations"][0]["by_domain"].values())
    assert len(result["ablations"][0]["controls"]) == 2
    assert all(4 not in c["experts"] for c in result["ablations"][0]["controls"])


def test_ablating_all_but_k_experts_is_a_router_that_can_only_choose_them():
    cfg = replace_moe(tiny_model_cfg(), n_group=1, topk_group=1)
    model = Transformer(cfg).eval()
    keep = [1, 3, 6]  # k = 3
    only = Transformer(cfg).eval()
    only.load_state_dict(model.state_dict())
    with torch.no_grad():
        for e in set(range(8)) - set(keep):
            only.layers[1].mlp.gate.e_score_correction_bias[e] = -1e4
    tokens = torch.randint(0, 97, (3, 30))
    with torch.no_grad(), route_around(transformer_routing(model), 1, [e for e in range(8) if e not in keep]):
        torch.testing.assert_close(model(tokens).logits, only(tokens).logits, rtol=0, atol=1e-6)


def test_ablate_experts_cli_writes_the_table_the_json_and_the_figure(trained_run, cli, tmp_path):
    run = trained_run(max_steps=2)
    proc = cli("ablate", "--run", run, "--out", tmp_path / "abl", "--n-boot", "100")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "abl" / "ablation.json").read_text())
    assert result["ablations"] and set(result["base_loss"]) == {"astronomy", "cooking", "finance"}
    for row in result["ablations"]:  # default targets: the most loaded expert of some domain, one per row
        assert row["layer"] == 1 and len(row["experts"]) == 1 and len(row["controls"]) == 3
        for v in row["by_domain"].values():
            assert v["ci95"][0] <= v["delta"] <= v["ci95"][1]
    assert (tmp_path / "abl" / "ablation.png").is_file() and "| ablated | domain |" in proc.stdout
    bad = cli("ablate", "--run", run, "--out", tmp_path / "x", "--targets", "7:1")
    assert bad.returncode != 0 and "MoE layers are [1]" in bad.stderr


def test_routing_around_one_expert_of_a_group_keeps_its_partner():
    """Groups are chosen as always; only the ablated expert is dropped before the top-k (tiny: groups of two)."""
    model = Transformer(tiny_model_cfg()).eval()  # 8 experts in 4 groups of 2, top-2 groups, k = 3
    tokens = torch.randint(0, 97, (4, 40))
    with RoutingRecorder(routers_by_layer(model)) as rec, torch.no_grad():
        model(tokens)
        before = rec.last[1][0].clone()
        with route_around(transformer_routing(model), 1, [0]):
            model(tokens)
            after = rec.last[1][0]
    had_0 = (before == 0).any(-1)
    assert had_0.any()
    # a token that had expert 0 keeps its other choices, and expert 1 (0's group partner) is still chosen
    for b, a in zip(before[had_0], after[had_0], strict=True):
        assert set(b.tolist()) - {0} <= set(a.tolist()) and 0 not in a.tolist()
    assert (after == 1).any()
