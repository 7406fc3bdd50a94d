"""The research variants' objectives: the prefix-LM labels, no label visible to the position that predicts it, a
prefix-LM run (bidirectional prefix) that trains and evaluates on the target tokens only; the MLM masks and run."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from moe_lm.config import ConfigError, load_config
from moe_lm.experiments.variants.objectives import MLM, PrefixLM
from moe_lm.model import Transformer
from moe_lm.testing import tiny_model_cfg
from moe_lm.train.objective import IGNORE, NEXT_TOKEN, loss_sums, next_token_losses, objective_for
from tests.helpers.runs import tiny_train_cfg, with_train


def test_prefix_lm_labels_only_the_tokens_after_the_prefix():
    window = torch.arange(10).view(1, 10) + 100
    assert NEXT_TOKEN.labels(window).tolist() == [list(range(101, 110))]
    labels = PrefixLM(prefix_len=4).labels(window)
    assert labels.tolist() == [[IGNORE] * 3 + list(range(104, 110))]  # t_4 .. t_9: what follows the prefix


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_no_labelled_token_is_visible_to_the_position_that_predicts_it(attention):
    """Under the bidirectional prefix, every labelled position j (j >= P - 1) is unchanged when its label t_{j+1}
    changes; and a prefix position does see later prefix tokens (the mask is really bidirectional there)."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(tiny_model_cfg(attention), attn_mask="prefix")).eval()
    objective, P = PrefixLM(prefix_len=6, model_reads_prefix=True), 6
    window = torch.randint(0, 97, (1, 17))
    base, labels = objective.run(model, window)
    for j in range(16):
        changed = window.clone()
        changed[0, j + 1] = (window[0, j + 1] + 1) % 97
        moved = (objective.run(model, changed)[0].logits[0, j] - base.logits[0, j]).abs().max()
        if labels[0, j] != IGNORE:
            assert moved < 1e-5, (j, moved)
        elif j + 1 < P:
            assert moved > 1e-4, (j, moved)  # inside the prefix the next token is visible: not a label


def test_prefix_objective_losses_count_only_the_targets():
    torch.manual_seed(0)
    model = Transformer(tiny_model_cfg()).eval()
    window = torch.randint(0, 97, (2, 13))
    objective = PrefixLM(prefix_len=5)
    out, labels = objective.run(model, window)
    ce, _ = next_token_losses(out, labels)
    want = F.cross_entropy(out.logits[:, 4:].flatten(0, 1), window[:, 5:].flatten())
    torch.testing.assert_close(ce, want)
    nll, n, _ = loss_sums(out, labels)
    assert n == 2 * 8 and nll / n == pytest.approx(want.item(), rel=1e-6)


def test_prefix_lm_config_rules():
    with pytest.raises(ConfigError, match="objective.prefix_len"):
        load_config("configs/tiny.yaml", ["objective.name=prefix_lm"])
    with pytest.raises(ConfigError, match="objective.prefix_len"):
        load_config("configs/tiny.yaml", ["objective.name=prefix_lm", "objective.prefix_len=256"])
    cfg = load_config(
        "configs/tiny.yaml", ["objective.name=prefix_lm", "objective.prefix_len=128", "model.attn_mask=prefix"]
    )
    o = objective_for(cfg)
    assert (type(o), o.prefix_len, o.model_reads_prefix) == (PrefixLM, 128, True)


def test_a_prefix_lm_run_trains_and_evaluates_on_targets(tiny_data, tmp_path, train):
    cfg = tiny_train_cfg(
        tiny_data, tmp_path / "run", max_steps=4, eval_interval=4, objective="prefix_lm", prefix_len=16
    )
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attn_mask="prefix"))
    final = train(cfg)
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]
    # the eval loss is over the targets only: recomputed from the checkpoint on the same windows
    from moe_lm.checkpoint.format import load_model
    from moe_lm.data.batches import eval_windows
    from moe_lm.data.prepare import load_split

    _, model, _ = load_model(tmp_path / "run")
    windows = eval_windows(load_split(cfg.data.out_dir, "val"), cfg.train.seq_len, cfg.train.micro_batch_size)
    nll = n = 0
    with torch.no_grad():
        for w in windows.values():
            s, c, _ = loss_sums(*objective_for(cfg).run(model, w))
            nll, n = nll + s, n + c
    assert final["loss"] == pytest.approx(nll / n, rel=1e-5)


def test_mlm_masks_are_fixed_by_the_window_and_follow_the_80_10_10_recipe():
    objective = MLM(mlm_prob=0.15, vocab_size=97, seed=3)
    window = torch.randint(1, 97, (64, 257), generator=torch.Generator().manual_seed(0))
    inputs, labels = objective.corrupt(window[:, :-1])
    again, labels2 = objective.corrupt(window[:, :-1].flip(0))  # same windows in another batch order
    assert torch.equal(again.flip(0), inputs) and torch.equal(labels2.flip(0), labels)
    other_seed = MLM(mlm_prob=0.15, vocab_size=97, seed=4).corrupt(window[:, :-1])[1]
    assert not torch.equal(other_seed, labels)
    chosen = labels != IGNORE
    assert abs(chosen.float().mean().item() - 0.15) < 0.01  # 16k positions
    assert torch.equal(labels[chosen], window[:, :-1][chosen]) and torch.equal(inputs[~chosen], window[:, :-1][~chosen])
    masked = (inputs[chosen] == 0).float().mean().item()
    kept = (inputs[chosen] == labels[chosen]).float().mean().item()
    assert abs(masked - 0.8) < 0.03 and abs(kept - 0.1 - 0.1 / 97) < 0.03  # random replacements sometimes hit it


def test_mlm_config_rules_and_a_run(tiny_data, tmp_path, train):
    with pytest.raises(ConfigError, match="needs objective.name=mlm"):
        load_config("configs/tiny.yaml", ["model.attn_mask=bidirectional"])
    with pytest.raises(ConfigError, match="objective.name = mlm predicts tokens in place"):
        load_config("configs/tiny.yaml", ["objective.name=mlm"])
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=3, eval_interval=3)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attn_mask="mixed_heads"))
    cfg = with_train(cfg, objective="mlm")
    final = train(cfg)
    assert 0 < final["loss"] < 8  # the masked tokens' loss, near ln(300) at this point
