"""A tiny prepared corpus and a tiny training config shared by the training tests."""

from __future__ import annotations

import dataclasses

import pytest

from moe_lm.config import Config, DataConfig, LoggingConfig, MLAConfig, ModelConfig, MoEConfig, OptimConfig, TrainConfig
from moe_lm.data.prepare import prepare_data
from tests.data.test_data import write_folder_corpus

VOCAB = 300


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_data")
    corpus = write_folder_corpus(root / "corpus", n_docs=12)
    cfg = DataConfig(sources=[str(corpus)], out_dir=str(root / "prepared"), val_fraction=0.2)
    prepare_data(cfg, vocab_size=VOCAB, log=lambda s: None)
    return cfg


def tiny_train_cfg(data: DataConfig, out_dir, **train) -> Config:
    model = ModelConfig(
        vocab_size=VOCAB,
        dim=32,
        n_layers=2,
        n_heads=2,
        inter_dim=64,
        first_k_dense_replace=1,
        max_seq_len=64,
        mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
        moe=MoEConfig(
            n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_inter_dim=16, bias_update_speed=1e-2
        ),
    )
    t = dict(
        max_steps=6,
        seq_len=32,
        micro_batch_size=4,
        grad_accum_steps=2,
        out_dir=str(out_dir),
        log_interval=1,
        eval_interval=3,
        eval_batches=1,
        ckpt_interval=3,
        keep_last=2,
    )
    t.update(train)
    cfg = Config(
        seed=1,
        model=model,
        data=dataclasses.replace(data),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        train=TrainConfig(**t),
        logging=LoggingConfig(wandb_mode="disabled"),
    )
    cfg.validate()
    return cfg
