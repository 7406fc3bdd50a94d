"""The memory and speed options (activation checkpointing, torch.compile, the chunked loss): the same losses and
gradients as the plain model, and the routers count each token once."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from moe_lm.checkpoint.format import load_model
from moe_lm.config import MTPConfig
from moe_lm.model import Transformer
from moe_lm.testing import tiny_model_cfg
from moe_lm.train.recompute import apply_activation_checkpointing
from tests.helpers.runs import tiny_train_cfg, with_train


def step(model, tokens):
    out = model(tokens[:, :-1], mtp=True)
    loss = F.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten()) + out.aux_loss
    for k, logits in enumerate(out.mtp_logits, start=1):
        loss = loss + 0.3 * F.cross_entropy(logits.flatten(0, 1), tokens[:, 1 + k :].flatten())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, [r.tokens_per_expert.clone() for r in model.routers()]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_changes_neither_losses_nor_gradients_nor_counts(mode):
    torch.manual_seed(0)
    base = Transformer(dataclasses.replace(tiny_model_cfg(), mtp=MTPConfig(depth=1))).train()
    tokens = torch.randint(0, 97, (2, 17))
    ref = step(copy.deepcopy(base), tokens)
    model = apply_activation_checkpointing(copy.deepcopy(base), mode)
    got = step(model, tokens)
    assert got[0] == ref[0]
    assert got[1].keys() == ref[1].keys() and all(torch.equal(got[1][k], ref[1][k]) for k in ref[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], ref[2], strict=True))  # recompute did not count again
    assert all(c.sum() > 0 for c in got[2])
    assert model.state_dict().keys() == base.state_dict().keys()  # checkpoints keep their keys


def test_compiled_and_checkpointed_training_matches_the_plain_run(tiny_data, tmp_path, train, trained_run):
    """Two steps through the real loop (DeepSpeed engine) with performance.compile and selective checkpointing: the
    losses of the plain run (the first steps include compiling, ~1 min on a 2-core CPU)."""
    plain = trained_run(max_steps=2, eval_interval=2)  # the plain reference, shared
    fast = tiny_train_cfg(tiny_data, tmp_path / "fast", max_steps=2, eval_interval=2)
    train(with_train(fast, compile=True, activation_checkpointing="selective"))

    def losses(run):
        rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows]

    assert losses(tmp_path / "fast") == pytest.approx(losses(plain), rel=1e-5)


def test_chunked_loss_training_matches_the_plain_run(tiny_data, tmp_path, train):
    """performance.loss_chunk through the real loop (DeepSpeed engine), with an MTP module whose head shares the chunked
    loss: every step's losses (main and MTP depth), the evaluations and the final weights are the plain run's."""
    cfg = tiny_train_cfg(tiny_data, tmp_path / "plain", max_steps=4, ckpt_interval=4)
    # Adam eps 1e-6, not 1e-8: at a gradient element near 0, the update g/(|g|+eps) has slope 1/eps, which turns the
    # chunked sum's fp32 rounding (~1e-10) into weight differences past the 1e-5 below on some hosts (a CI run failed
    # on lm_head); at 1e-6 the amplification is 100x smaller and a wrong gradient still moves weights by ~lr.
    model, optim = dataclasses.replace(cfg.model, mtp=MTPConfig(depth=1)), dataclasses.replace(cfg.optim, eps=1e-6)
    cfg = dataclasses.replace(cfg, model=model, optim=optim)
    train(cfg)
    chunked = with_train(cfg, out_dir=str(tmp_path / "chunked"), loss_chunk=7)
    train(chunked)

    def rows(run):
        return [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]

    plain, got = rows(tmp_path / "plain"), rows(tmp_path / "chunked")
    assert [r.get("kind") for r in got] == [r.get("kind") for r in plain]
    for a, b in zip(got, plain, strict=True):
        for key in ("loss", "mtp_loss/depth_1", "aux_loss"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert any("mtp_loss/depth_1" in r for r in got)
    w_plain = load_model(tmp_path / "plain")[1].state_dict()
    w_chunked = load_model(tmp_path / "chunked")[1].state_dict()
    for name, value in w_plain.items():
        torch.testing.assert_close(w_chunked[name], value, rtol=1e-4, atol=1e-5, msg=name)
