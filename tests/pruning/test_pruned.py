"""The pruned model against its definition: the unpruned model with the removed experts' selection bias at -inf."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from moe_lm.checkpoint.format import load_model
from moe_lm.checkpoint.weights_only import write_weights
from moe_lm.config import Config, TrainConfig
from moe_lm.model import Transformer
from moe_lm.pruning.masked import removed
from moe_lm.pruning.plan import KeepPlan
from moe_lm.pruning.pruned import pruned_config, pruned_model
from moe_lm.testing import tiny_model_cfg

# 16 experts in 4 groups of 4, top-2 groups, top-3 experts: each group may keep 2 or 3
GROUPED = dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3)


def grouped_model(seed: int = 0) -> tuple[Config, Transformer]:
    torch.manual_seed(seed)
    cfg = Config(model=tiny_model_cfg(moe=GROUPED), train=TrainConfig(seq_len=32))
    model = Transformer(cfg.model).eval()
    with torch.no_grad():  # uneven selection biases and sharper router scores: many group decisions change
        for router in model.routers():
            router.e_score_correction_bias.uniform_(-0.3, 0.3)
            router.weight.mul_(20)
    return cfg, model


def random_plan(model: Transformer, n_keep: int, seed: int = 0) -> KeepPlan:
    rng = np.random.default_rng(seed)
    layers = [i for i in model.moe_layer_ids() if i < model.cfg.n_layers]
    return KeepPlan.from_scores({layer: rng.random(16) for layer in layers}, n_keep, 4)


@pytest.mark.parametrize("n_keep", [8, 12])
def test_pruned_logits_are_the_unpruned_models_with_the_removed_experts_bias_at_minus_inf(n_keep):
    cfg, model = grouped_model()
    plan = random_plan(model, n_keep)
    pruned = pruned_model(model, cfg, plan)
    assert pruned.cfg.moe.n_routed_experts == n_keep and pruned.cfg.moe.n_group == 4
    tokens = torch.randint(0, 97, (4, 40))
    with torch.no_grad():
        before = model(tokens).logits
        reference = Transformer(cfg.model).eval()
        reference.load_state_dict(model.state_dict())
        for layer, router in zip(reference.moe_layer_ids(), reference.routers(), strict=True):
            router.e_score_correction_bias[plan.removed(layer)] = float("-inf")
        expected = reference(tokens).logits
        got = pruned(tokens).logits
        with removed(dict(zip(model.moe_layer_ids(), model.routers(), strict=True)),
                     {layer: plan.removed(layer) for layer in plan.layers}):  # fmt: skip
            masked = model(tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(masked, expected, rtol=0, atol=0)
    assert not torch.allclose(before, expected, atol=1e-3)  # the removal changed something: the test can see it
    assert torch.equal(model(tokens).logits, before)  # `removed` put the biases back


def test_ungrouped_pruned_logits_are_the_ungrouped_models_with_the_removed_experts_bias_at_minus_inf():
    """--ungroup: 7 of 16 kept (no equal share of 4 groups), the pruned model routing without groups, equals the
    unpruned weights routed without groups (n_group 1) with the removed experts' bias at -inf."""
    cfg, model = grouped_model(2)
    rng = np.random.default_rng(0)
    layers = [i for i in model.moe_layer_ids() if i < model.cfg.n_layers]
    plan = KeepPlan.from_scores({layer: rng.random(16) for layer in layers}, 7, 1)
    pruned = pruned_model(model, cfg, plan)
    assert (pruned.cfg.moe.n_routed_experts, pruned.cfg.moe.n_group, pruned.cfg.moe.topk_group) == (7, 1, 1)
    ungrouped = dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe, n_group=1, topk_group=1))
    reference = Transformer(ungrouped).eval()
    reference.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 97, (4, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for layer, router in zip(reference.moe_layer_ids(), reference.routers(), strict=True):
            router.e_score_correction_bias[plan.removed(layer)] = float("-inf")
        expected = reference(tokens).logits
        torch.testing.assert_close(pruned(tokens).logits, expected, rtol=1e-5, atol=1e-5)
        with removed(dict(zip(model.moe_layer_ids(), model.routers(), strict=True)),
                     {layer: plan.removed(layer) for layer in plan.layers}):  # fmt: skip
            grouped_masked = model(tokens).logits
    assert not torch.allclose(grouped_masked, expected, atol=1e-3)  # the groups mattered: dropping them is seen


def test_pruned_routers_choose_only_among_kept_experts_renumbered_in_order():
    cfg, model = grouped_model(1)
    plan = random_plan(model, 8, seed=3)
    pruned = pruned_model(model, cfg, plan)
    for layer, moe in zip(pruned.moe_layer_ids(), pruned.moe_layers(), strict=True):
        source = model.layers[layer].mlp
        kept = torch.tensor(plan.kept[layer])
        assert torch.equal(moe.gate.weight, source.gate.weight[kept])
        assert torch.equal(moe.gate.e_score_correction_bias, source.gate.e_score_correction_bias[kept])
        assert torch.equal(moe.experts.down_proj, source.experts.down_proj[kept])
        assert torch.equal(moe.shared_experts.down_proj.weight, source.shared_experts.down_proj.weight)


def test_a_written_checkpoint_loads_as_the_model_it_was_written_from(tmp_path):
    cfg, model = grouped_model()
    pruned = pruned_model(model, cfg, random_plan(model, 12))
    no_data = {"data_dir": str(tmp_path), "tokenizer_sha256": None}
    write_weights(pruned, pruned_config(cfg, random_plan(model, 12)), tmp_path / "run", "step_00000007", no_data)
    loaded_cfg, loaded, tag = load_model(tmp_path / "run")
    assert tag == "step_00000007" and loaded_cfg.model.moe.n_routed_experts == 12
    tokens = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, pruned(tokens).logits)
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints" / "step_00000007").glob("layer_*"))
    assert len(names) == 2 * 12 and "layer_1_expert_11_mp_rank_00_model_states.pt" in names
