"""Drift split into routing and weights (moe_lm/analysis/attribution.py, routes forced by moe_lm/routing/forced.py):
a copy with the reference's weights attributes nothing to weights; one whose router alone was moved attributes the
whole change to routing, with no interaction; one whose experts moved has a weights part."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_lm.analysis.attribution import drift_attribution, window_passes
from moe_lm.model import Transformer
from moe_lm.routing.forced import captured_routes, forced_routes
from moe_lm.testing import tiny_model_cfg


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
    with torch.no_grad(), captured_routes(ref) as own:
        plain = ref(t).logits
    with torch.no_grad(), forced_routes(ref, dict(own)):
        assert torch.equal(ref(t).logits, plain)
    with torch.no_grad(), captured_routes(moved) as theirs:
        moved(t)
    assert any(not torch.equal(own[layer][0], theirs[layer][0]) for layer in own)  # the moved bias moved choices
    with torch.no_grad(), forced_routes(ref, dict(theirs)), captured_routes(ref) as seen:
        ref(t)
    assert all(torch.equal(seen[layer][0], theirs[layer][0]) for layer in theirs)


def test_equal_weights_attribute_nothing(models):
    ref, same, _, _, docs = models
    passes = window_passes(ref, same, docs[0][1][:32])
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
