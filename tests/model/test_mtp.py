"""Multi-token prediction: the modules and loss against a reference written here, causality per depth, gradients,
the bias update, and D = 0 leaving the model exactly as it was."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
import torch.nn.functional as F

import moe_lm.experiments.variants  # noqa: F401  (registers the research variants used below)
from moe_lm.config import ConfigError, MTPConfig, load_config
from moe_lm.model import Transformer, count_params
from moe_lm.model.attention import rope_cos_sin
from moe_lm.model.block import Block
from moe_lm.testing import replace_moe, tiny_model_cfg
from moe_lm.train.balance import balance_step
from moe_lm.train.objective import next_token_losses, total_loss
from moe_lm.train.schedule import mtp_weight_at


def with_mtp(cfg, depth: int, **kw):
    return dataclasses.replace(cfg, mtp=MTPConfig(depth=depth, **kw))


def reference_mtp_loss(model: Transformer, tokens_BS1: torch.Tensor, weight: float) -> tuple[torch.Tensor, list]:
    """DeepSeek-V3's L_MTP the way Megatron-Core computes it: full-length sequences rolled left by one per depth,
    the positions past the window's end masked out of a per-depth mean, then (lambda / D) * sum."""
    inputs, targets = tokens_BS1[:, :-1], tokens_BS1[:, 1:]
    B, S = inputs.shape
    out = model(inputs)
    h, rolled, labels, per_depth = out.hidden, inputs, targets, []
    positions = torch.arange(S)
    cos, sin = rope_cos_sin(model.inv_freq, positions, h.dtype, model.rope_factor)
    for k, module in enumerate(model.mtp, start=1):
        rolled = torch.roll(rolled, -1, dims=1)  # token i + k at position i (wrapped garbage past S - k)
        labels = torch.roll(labels, -1, dims=1)
        x = module.eh_proj(torch.cat((module.enorm(model.embed_tokens(rolled)), module.hnorm(h)), -1))
        h, _ = Block.forward(module, x, cos, sin, None)  # the module's block on the projected input
        logits = model.lm_head(module.shared_head.norm(h))
        valid = positions < S - k  # causal attention: the wrapped tail cannot reach earlier positions
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(B, S)
        per_depth.append((ce * valid).sum() / (valid.sum() * B))
    return weight / len(per_depth) * torch.stack(per_depth).sum(), per_depth


@pytest.mark.parametrize("attention", ["mla", "gqa"])
@pytest.mark.parametrize("depth", [1, 3])
def test_mtp_loss_equals_a_rolled_reference(attention, depth):
    torch.manual_seed(0)
    model = Transformer(with_mtp(tiny_model_cfg(attention), depth)).eval()
    tokens = torch.randint(0, 97, (3, 17))
    out = model(tokens[:, :-1], mtp=True)
    assert [tuple(x.shape) for x in out.mtp_logits] == [(3, 16 - k, 97) for k in range(1, depth + 1)]
    ce, mtp = next_token_losses(out, tokens[:, 1:])
    ref_total, ref_depths = reference_mtp_loss(model, tokens, weight=0.3)
    for got, want in zip(mtp, ref_depths, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ce, F.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten()))
    total = total_loss(ce, mtp, 0.3, out.aux_loss)
    torch.testing.assert_close(total, ce + ref_total + out.aux_loss, rtol=1e-5, atol=1e-6)


def test_depth_zero_is_the_model_without_mtp_byte_for_byte():
    """D = 0 keeps today's model: the same tensors from the same seed as before MTP existed (hashes taken from the
    code before this feature), no MTP key, and forward(mtp=True) changes nothing."""
    before = {  # sha256 over (key, bytes) of the seed-0 state dicts, computed at the commit before MTP
        "tiny_mla": "6b730f3b8addbc752a851e2c623b4ba65c5f17b629d62dc7afb611b30b03894c",
        "preset": "2b1866c5ffbef8b3472502b33d8e5e19dabb64d5538d564991e54d1f030a3ae3",
    }
    for name, cfg in (("tiny_mla", tiny_model_cfg()), ("preset", load_config("configs/tiny.yaml").model)):
        torch.manual_seed(0)
        model = Transformer(cfg)
        digest = hashlib.sha256()
        for key, tensor in model.state_dict().items():
            digest.update(key.encode())
            digest.update(tensor.contiguous().numpy().tobytes())
        assert digest.hexdigest() == before[name]
        assert not any(k.startswith("mtp.") for k in model.state_dict())
    tokens = torch.randint(0, 97, (2, 12))
    model = Transformer(tiny_model_cfg()).eval()
    a, b = model(tokens), model(tokens, mtp=True)
    assert torch.equal(a.logits, b.logits) and b.mtp_logits == []


def test_main_model_starts_the_same_at_every_depth():
    """Same seed, same main-model weights with and without MTP: paired comparisons start from one model."""
    states = []
    for depth in (0, 2):
        torch.manual_seed(3)
        states.append(Transformer(with_mtp(tiny_model_cfg(), depth)).state_dict())
    main = [k for k in states[1] if not k.startswith("mtp.")]
    assert main == list(states[0])
    assert all(torch.equal(states[0][k], states[1][k]) for k in main)


@pytest.mark.parametrize("depth", [1, 2])
def test_every_depth_is_causal(depth):
    """Depth k at position i reads tokens up to i + k and predicts i + k + 1: changing token m moves depth-k logits
    only at positions i >= m - k (and does move the first of them)."""
    torch.manual_seed(0)
    model = Transformer(with_mtp(tiny_model_cfg(), depth)).eval()
    tokens = torch.randint(0, 97, (1, 16))
    m = 9
    changed = tokens.clone()
    changed[0, m] = (tokens[0, m] + 1) % 97
    a, b = model(tokens, mtp=True), model(changed, mtp=True)
    for k, (la, lb) in enumerate(zip(a.mtp_logits, b.mtp_logits, strict=True), start=1):
        # (float rounding of the attention kernels is ~1e-7; a dependence shows at the logits' own scale)
        torch.testing.assert_close(la[:, : m - k], lb[:, : m - k], rtol=0, atol=1e-6)
        assert (la[:, m - k] - lb[:, m - k]).abs().max() > 1e-3


def test_mtp_gradients_reach_the_shared_embedding_and_head_only_through_mtp():
    torch.manual_seed(0)
    model = Transformer(with_mtp(tiny_model_cfg(), 2)).train()
    tokens = torch.randint(0, 97, (2, 13))
    out = model(tokens[:, :-1], mtp=True)
    _, mtp = next_token_losses(out, tokens[:, 1:])
    torch.stack(mtp).sum().backward()
    assert model.embed_tokens.weight.grad.abs().sum() > 0 and model.lm_head.weight.grad.abs().sum() > 0
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.mtp.named_parameters() if "experts" not in n
    )
    # the main head's loss never reaches the MTP modules
    model.zero_grad(set_to_none=True)
    out = model(tokens[:, :-1], mtp=True)
    ce, _ = next_token_losses(out, tokens[:, 1:])
    ce.backward()
    assert all(p.grad is None for p in model.mtp.parameters())


def test_bias_update_and_balance_losses_cover_the_mtp_routers():
    cfg = with_mtp(replace_moe(tiny_model_cfg(), seq_aux_alpha=1e-2), 2)
    model = Transformer(cfg).train()
    assert model.moe_layer_ids() == [1, 2, 3, 4] and len(model.routers()) == 4  # layers 3, 4 are the MTP blocks
    tokens = torch.randint(0, 97, (2, 16))
    per_layer = []
    for moe in model.moe_layers():
        moe.register_forward_hook(lambda m, i, o: per_layer.append(o[1]))
    out = model(tokens, mtp=True)
    assert len(per_layer) == 4 and all(a > 0 for a in per_layer)  # the MTP blocks' own balance losses...
    torch.testing.assert_close(out.aux_loss, sum(per_layer))  # ...are in the returned aux_loss
    counts = [r.tokens_per_expert.sum().item() for r in model.routers()]
    K = cfg.moe.num_experts_per_tok
    assert counts == [2 * 16 * K, 2 * 16 * K, 2 * 15 * K, 2 * 14 * K]  # depth k routes S - k positions
    before = [r.e_score_correction_bias.clone() for r in model.routers()]
    metrics, _ = balance_step(model, speed=0.01)
    after = [r.e_score_correction_bias for r in model.routers()]
    assert all(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
    assert "maxvio/layer_4" in metrics and all(r.tokens_per_expert.sum() == 0 for r in model.routers())


def test_param_counts_with_mtp():
    cfg = with_mtp(tiny_model_cfg(), 2)
    model = Transformer(cfg)
    n = count_params(cfg)
    assert n.mtp_total == sum(p.numel() for p in model.mtp.parameters())
    assert n.total == sum(p.numel() for p in model.parameters()) - n.mtp_total
    routed = sum(p.numel() for p in model.mtp[0].mlp.experts.parameters())
    E, K = cfg.moe.n_routed_experts, cfg.moe.num_experts_per_tok
    assert n.mtp_active == n.mtp_total - 2 * routed * (E - K) // E


def test_loss_weight_schedule_in_steps_or_a_fraction():
    fraction = MTPConfig(depth=1, loss_weight=0.3, late_loss_weight=0.1, late_start=0.68)
    assert [mtp_weight_at(s, fraction, 100) for s in (0, 67, 68, 99)] == [0.3, 0.3, 0.1, 0.1]
    steps = dataclasses.replace(fraction, late_start=40)
    assert [mtp_weight_at(s, steps, 100) for s in (39, 40)] == [0.3, 0.1]
    assert mtp_weight_at(99, dataclasses.replace(fraction, late_start=0), 100) == 0.3
    assert mtp_weight_at(0, MTPConfig(depth=0), 100) == 0.0


def test_config_errors_for_mtp():
    with pytest.raises(ConfigError, match="model.mtp.depth"):
        load_config("configs/tiny.yaml", ["model.mtp.depth=-1"])
    with pytest.raises(ConfigError, match="model.mtp.depth.*causal"):
        load_config("configs/tiny.yaml", ["model.mtp.depth=1", "model.attn_mask=prefix"])
    with pytest.raises(ConfigError, match="model.mtp.loss_weight"):
        load_config("configs/tiny.yaml", ["model.mtp.depth=1", "model.mtp.loss_weight=nan"])
    with pytest.raises(ConfigError, match="model.mtp.depth.*train.seq_len"):
        load_config("configs/tiny.yaml", ["model.mtp.depth=4", "train.seq_len=4"])
