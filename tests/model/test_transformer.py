"""The whole model: parameter counts, aux loss plumbing, it learns, and model code stays single-device."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moe_lm.config import load_config
from moe_lm.model import MoE, Transformer, count_params
from moe_lm.testing import replace_moe, tiny_model_cfg

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("attention", ["mla", "gqa"])
@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_param_count_matches_modules(attention, q_lora_rank):
    cfg = tiny_model_cfg(attention)
    cfg = dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, q_lora_rank=q_lora_rank))
    model = Transformer(cfg)
    counted = count_params(cfg)
    assert counted.total == sum(p.numel() for p in model.parameters())
    # active: every parameter except the routed experts a token skips
    routed = sum(p.numel() for moe in model.moe_layers() for p in moe.experts.parameters())
    E, K = cfg.moe.n_routed_experts, cfg.moe.num_experts_per_tok
    assert counted.active == counted.total - routed * (E - K) // E
    assert counted.routed_expert * E * len(model.moe_layers()) == routed


def test_tiny_preset_structure():
    cfg = load_config(ROOT / "configs" / "tiny.yaml").model
    model = Transformer(cfg)
    assert len(model.moe_layers()) == cfg.n_layers - cfg.first_k_dense_replace
    assert not isinstance(model.layers[0].mlp, MoE)
    assert all(isinstance(layer.mlp, MoE) for layer in model.layers[cfg.first_k_dense_replace :])


def test_output_and_aux_loss():
    cfg = replace_moe(tiny_model_cfg(), seq_aux_alpha=1e-2)
    model = Transformer(cfg)
    tokens = torch.randint(0, 97, (2, 16))
    out = model.train()(tokens)
    assert out.logits.shape == (2, 16, 97)
    assert out.aux_loss.item() > 0 and out.aux_loss.requires_grad
    # the sum over MoE layers of each layer's returned loss, nothing kept in globals
    per_layer = []
    for moe in model.moe_layers():
        moe.register_forward_hook(lambda m, i, o: per_layer.append(o[1]))
    out = model(tokens)
    torch.testing.assert_close(out.aux_loss, sum(per_layer))
    assert model.eval()(tokens).aux_loss.item() == 0.0


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_tiny_model_overfits_one_batch(attention):
    cfg = tiny_model_cfg(attention)
    model = Transformer(cfg).train()
    tokens = torch.randint(0, 97, (4, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        out = model(tokens[:, :-1])
        loss = F.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten())
        (loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[0] > 4.0  # ~ln(97) at init
    assert losses[-1] < 0.2 * losses[0]
