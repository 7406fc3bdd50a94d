"""Evaluation during training: `loss_scored` is the loss on the labels at window positions >= score_from, whatever
labels the run trains on (the curves an experiment draws compare its arms on the same labels)."""

from __future__ import annotations

import pytest
import torch

from moe_lm.experiments.variants.objectives import PrefixLM
from moe_lm.model import Transformer
from moe_lm.parallel.deepspeed_setup import init_distributed
from moe_lm.testing import tiny_model_cfg
from moe_lm.train.evaluate import evaluate
from moe_lm.train.objective import NEXT_TOKEN


def test_loss_scored_is_the_loss_on_the_labels_from_score_from():
    init_distributed()  # a world of one
    torch.manual_seed(0)
    cfg = tiny_model_cfg()
    model = Transformer(cfg).eval()
    evalsets = {d: torch.randint(3, cfg.vocab_size, (5, 25)) for d in ("a", "b")}
    P = 9
    every = evaluate(model, model, evalsets, 2, torch.device("cpu"), 1, NEXT_TOKEN, score_from=P)
    # the reference: the prefix-LM labels (positions >= P) on the same causal model, which PrefixLM scores as `loss`
    targets = evaluate(model, model, evalsets, 2, torch.device("cpu"), 1, PrefixLM(P), score_from=1)
    assert every["loss_scored"] == pytest.approx(targets["loss"], rel=1e-6)
    assert abs(every["loss_scored"] - every["loss"]) > 1e-4  # a different set of labels than every token
    # a run trained on those targets: its loss is already the scored one
    assert evaluate(model, model, evalsets, 2, torch.device("cpu"), 1, PrefixLM(P), P)["loss_scored"] == pytest.approx(
        targets["loss"], rel=1e-6
    )
    assert "loss_scored" not in targets
