"""Starting from a pretrained transformers checkpoint, and the used-by command on a fresh clone."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from moe_lm.config import ConfigError
from moe_lm.data.batches import eval_windows
from moe_lm.data.prepare import load_split
from moe_lm.errors import DataError
from tests.helpers.runs import VOCAB, tiny_train_cfg


def tiny_hf_checkpoint(folder: Path) -> Path:
    """A DeepseekV3 checkpoint made by transformers itself: interleaved RoPE, group-limited routing, biases."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1, rope_interleave=True, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(3)
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else None
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    hf.save_pretrained(folder)
    return folder


@torch.no_grad()
def hf_validation_loss(path: Path, data_dir: str, seq_len: int, per_domain: int) -> float:
    """The loss transformers computes over the windows our evaluation uses."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    total, n = 0.0, 0
    for windows in eval_windows(load_split(data_dir, "val"), seq_len, per_domain).values():
        logits = hf(windows[:, :-1]).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="sum").item()
        n += windows[:, 1:].numel()
    return total / n


def test_step_zero_loss_of_a_pretrained_checkpoint_equals_transformers(tiny_data, tmp_path, train, capsys):
    path = tiny_hf_checkpoint(tmp_path / "hf")
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=2, init_from=f"hf:{path}")
    train(cfg)
    out = capsys.readouterr().out
    assert f"model.* from {path}/config.json" in out and "dim" in out  # the architecture came from the checkpoint
    evals = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step0 = next(r for r in evals if r["kind"] == "eval" and r["step"] == 0)
    t = cfg.train
    want = hf_validation_loss(path, cfg.data.out_dir, t.seq_len, cfg.cadence.eval_batches * t.micro_batch_size)
    assert step0["loss"] == pytest.approx(want, rel=1e-5)
    trained = [r for r in evals if r["kind"] == "train"]
    assert [r["step"] for r in trained] == [1, 2]  # then it trains like any run
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "dim: 32" in saved and "n_routed_experts: 8" in saved


def test_init_from_a_checkpoint_with_mtp_loads_its_modules(tiny_data, tmp_path, train, capsys):
    """An export with MTP (DeepSeek's layout) as train.init_from, with model.mtp.depth=1: the step-0 MTP loss is the
    checkpoint's own (recomputed here from import_hf); with depth 2 the second module starts afresh."""
    from moe_lm.config import MTPConfig
    from moe_lm.interop.hf import export_hf, import_hf
    from moe_lm.model import Transformer

    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=1)
    torch.manual_seed(5)
    source = Transformer(dataclasses.replace(cfg.model, mtp=MTPConfig(depth=1))).eval()
    export_hf(source, tmp_path / "hf")
    mtp = MTPConfig(depth=1)
    run = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mtp=mtp))
    run = dataclasses.replace(run, train=dataclasses.replace(run.train, init_from=f"hf:{tmp_path / 'hf'}"))
    train(run)
    assert "1 MTP module(s) in the checkpoint, 1 loaded, 0 initialised afresh" in capsys.readouterr().out
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step0 = next(r for r in rows if r["kind"] == "eval" and r["step"] == 0)
    imported, t = import_hf(tmp_path / "hf").eval(), run.train
    total = n = 0
    with torch.no_grad():
        for w in eval_windows(
            load_split(run.data.out_dir, "val"), t.seq_len, run.cadence.eval_batches * t.micro_batch_size
        ).values():
            logits = imported(w[:, :-1], mtp=True).mtp_logits[0]
            total += F.cross_entropy(logits.flatten(0, 1), w[:, 2:].flatten(), reduction="sum").item()
            n += w[:, 2:].numel()
    assert step0["mtp_loss/depth_1"] == pytest.approx(total / n, rel=1e-5)
    deeper = dataclasses.replace(run, model=dataclasses.replace(run.model, mtp=MTPConfig(depth=2)))
    train(dataclasses.replace(deeper, train=dataclasses.replace(deeper.train, out_dir=str(tmp_path / "run2"))))
    assert "1 MTP module(s) in the checkpoint, 1 loaded, 1 initialised afresh" in capsys.readouterr().out


def test_init_from_errors_and_resume_ignores_it(tiny_data, tmp_path, train, capsys):
    with pytest.raises(ConfigError, match="train.init_from=hf:.*nowhere: cannot load it"):
        train(tiny_train_cfg(tiny_data, tmp_path / "run", init_from=f"hf:{tmp_path / 'nowhere'}"))
    path = tiny_hf_checkpoint(tmp_path / "hf")
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run2", max_steps=2, init_from=f"hf:{path}")
    train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, stop_at=1)))
    train(cfg)
    out = capsys.readouterr().out
    assert "its weights are not loaded" in out and "resumed from" in out


def test_the_used_by_command_prepares_the_default_corpus_on_a_fresh_clone(tmp_path, launcher):
    """`deepspeed launch/train.py --config configs/tiny.yaml` with no prepared data: rank 0 prepares it."""
    overrides = [
        f"data.out_dir={tmp_path / 'data'}", f"train.out_dir={tmp_path / 'run'}", "data.max_mb_per_domain=0.3",
        "model.vocab_size=1024", "train.max_steps=2", "cadence.eval_batches=1", "logging.wandb_mode=disabled",
    ]  # fmt: skip
    cmd = launcher.deepspeed(2, launcher.free_port(), "launch/train.py", "--config", "configs/tiny.yaml", *overrides)
    proc = launcher.run(cmd, timeout=600)
    out = proc.stdout  # stdout and stderr merged
    assert proc.returncode == 0, out[-3000:]
    assert "preparing the embedded default corpus" in out and "world 2" in out
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step_00000002"


def test_user_sources_without_prepared_data_name_the_prepare_command(tiny_data, tmp_path, train):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, out_dir=str(tmp_path / "unprepared")))
    with pytest.raises(DataError, match="no prepared data in .*unprepared: run `moe-lm prepare"):
        train(cfg)
