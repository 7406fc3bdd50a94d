"""The encoder-decoder variant: parameter counts, no target visible to the encoder or to the position predicting
it, the decoder's causality, and a prefix-LM training run through the real loop."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_lm.checkpoint.format import load_model
from moe_lm.config import ConfigError, load_config
from moe_lm.experiments.variants.encdec import EncoderDecoder
from moe_lm.experiments.variants.objectives import PrefixLM
from moe_lm.model import build_model, count_params
from moe_lm.testing import tiny_model_cfg
from moe_lm.train.objective import objective_for
from tests.helpers.runs import tiny_train_cfg


def encdec_cfg(**fields):
    return dataclasses.replace(tiny_model_cfg("gqa"), arch="encdec", n_enc_layers=2, n_layers=2, **fields)


@pytest.mark.parametrize("first_k_dense_replace", [0, 1, 2])
def test_param_count_matches_modules(first_k_dense_replace):
    cfg = encdec_cfg(first_k_dense_replace=first_k_dense_replace)
    model = build_model(cfg)
    assert isinstance(model, EncoderDecoder)
    n = count_params(cfg)
    assert n.total == sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for moe in model.moe_layers() for p in moe.experts.parameters())
    E, K = cfg.moe.n_routed_experts, cfg.moe.num_experts_per_tok
    assert n.active == n.total - routed * (E - K) // E
    assert len(model.moe_layers()) == 2 * (2 - first_k_dense_replace)


def test_no_target_is_visible_to_the_encoder_or_to_the_position_predicting_it():
    torch.manual_seed(0)
    model = build_model(encdec_cfg()).eval()
    P, S = 6, 16
    window = torch.randint(0, 97, (1, S + 1))
    encoded = []
    model.enc_norm.register_forward_hook(lambda m, i, o: encoded.append(o))
    base, labels = PrefixLM(P, True).run(model, window)
    assert (base.logits[0, : P - 1] == 0).all() and labels[0, : P - 1].eq(-100).all()
    for m in range(1, S + 1):  # change token m: what may move is positions j >= m (and the encoder iff m < P)
        changed = window.clone()
        changed[0, m] = (window[0, m] + 1) % 97
        out, _ = PrefixLM(P, True).run(model, changed)
        if m < S:
            assert torch.equal(encoded[-1], encoded[0]) == (m >= P), m  # the encoder reads the prefix only
        moved = (out.logits[0] - base.logits[0]).abs().amax(-1)
        assert (moved[P - 1 : m] < 1e-6).all(), m  # positions before m (those predicting t_{<=m}) unchanged
        if m < S:
            assert moved[max(m, P - 1) :].max() > 1e-4, m  # and some later position does move


def test_encdec_config_rules():
    with pytest.raises(ConfigError, match="model.arch.*prefix_lm"):
        load_config("configs/tiny_gqa.yaml", ["model.arch=encdec", "model.n_enc_layers=2"])
    with pytest.raises(ConfigError, match="model.attention must be gqa"):
        load_config("configs/tiny.yaml", ["model.arch=encdec", "model.n_enc_layers=2", "objective.name=prefix_lm",
                                          "objective.prefix_len=64"])  # fmt: skip
    with pytest.raises(ValueError, match="prefix_len"):
        build_model(encdec_cfg())(torch.zeros(1, 8, dtype=torch.long))


def test_the_encoder_decoder_trains_with_the_plain_loss_whatever_the_loss_chunk():
    """The chunked loss needs a forward without logits, which the encoder-decoder lacks: its objective takes the
    plain loss (the same loss) at the default chunk, where the decoder-only model takes the chunk."""
    overrides = ["model.arch=encdec", "model.n_enc_layers=2", "objective.name=prefix_lm", "objective.prefix_len=64"]
    encdec = load_config("configs/tiny_gqa.yaml", overrides)
    decoder = load_config("configs/tiny_gqa.yaml", overrides[2:])
    assert encdec.performance.loss_chunk == decoder.performance.loss_chunk == 1024
    assert (objective_for(encdec).loss_chunk, objective_for(decoder).loss_chunk) == (0, 1024)


def test_an_encdec_run_trains_and_loads(tiny_data, tmp_path, train):
    cfg = tiny_train_cfg(
        tiny_data, tmp_path / "run", max_steps=3, eval_interval=3, objective="prefix_lm", prefix_len=16
    )
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="gqa", arch="encdec", n_enc_layers=2))
    final = train(cfg)
    assert final["loss"] > 0
    _, model, _ = load_model(tmp_path / "run")
    assert isinstance(model, EncoderDecoder)
