"""build_by_layer: each part of the model from its own seed, so a pipeline stage builds only its own layers with the
weights they have in the whole model."""

from __future__ import annotations

import dataclasses

import torch

from moe_lm.model import build_by_layer
from moe_lm.testing import tiny_model_cfg


def test_a_part_built_alone_has_its_weights_in_the_whole_model():
    cfg = dataclasses.replace(tiny_model_cfg(n_layers=4), mtp=dataclasses.replace(tiny_model_cfg().mtp, depth=1))
    whole = build_by_layer(cfg, seed=3).state_dict()
    kept = {"layers.2", "head", "mtp.0"}
    part = build_by_layer(cfg, seed=3, keep=kept.__contains__)
    real = {k: v for k, v in part.state_dict().items() if not v.is_meta}
    for key, value in real.items():
        if key.startswith(("layers.2.", "norm.", "lm_head.", "mtp.0.")):
            assert torch.equal(value, whole[key]), key
        else:  # another stage's layer: only its router is built (the balancing's state), its bias at zero
            assert ".mlp.gate." in key, key
            assert not key.endswith("e_score_correction_bias") or not value.any()
    assert {k for k in whole if k.startswith(("layers.2.", "norm.", "lm_head.", "mtp.0."))} <= set(real)
    assert part.embed_tokens.weight.is_meta and part.layers[0].self_attn.o_proj.weight.is_meta
    assert torch.equal(part.inv_freq, build_by_layer(cfg, seed=3).inv_freq) and not part.inv_freq.is_meta


def test_layer_seeds_give_the_same_main_model_with_and_without_mtp_and_differ_by_seed():
    cfg = tiny_model_cfg()
    with_mtp = dataclasses.replace(cfg, mtp=dataclasses.replace(cfg.mtp, depth=2))
    a, b = build_by_layer(cfg, seed=1).state_dict(), build_by_layer(with_mtp, seed=1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = build_by_layer(cfg, seed=2).state_dict()
    assert not torch.equal(a["layers.1.self_attn.o_proj.weight"], c["layers.1.self_attn.o_proj.weight"])
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert build_by_layer(cfg, seed=1)(tokens).logits.isfinite().all()


def test_a_pipelined_runs_initial_model_is_the_layer_seeded_one(tiny_data, tmp_path):
    """What the analytics' N1 baselines and `export --config` take as a run's starting weights: with pipeline stages
    (or train.layer_seeds) each part from its own seed, as the stages built them; otherwise drawn in turn."""
    from moe_lm.model import build_model, initial_model
    from tests.helpers.runs import tiny_train_cfg

    cfg = tiny_train_cfg(tiny_data, tmp_path / "run")
    staged = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp_size=2, zero_stage=1))
    want = build_by_layer(cfg.model, cfg.seed).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in initial_model(staged).state_dict().items())
    torch.manual_seed(cfg.seed)
    sequential = build_model(cfg.model).state_dict()
    assert all(torch.equal(v, sequential[k]) for k, v in initial_model(cfg).state_dict().items())
