"""A tiny multi-domain corpus and a training config on it (fp32, CPU), for the tests that train."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from moe_lm.config import CadenceConfig, Config, DataConfig, LoggingConfig, MLAConfig, OptimConfig, TrainConfig
from moe_lm.testing import tiny_model_cfg

WORDS = {
    "cooking": "stir the onions slowly until golden then add garlic salt pepper and a splash of wine".split(),
    "astronomy": "the telescope tracked a distant galaxy whose redshift revealed expansion of space".split(),
    "finance": "the bond yield rose while equity markets priced in higher interest rates and inflation".split(),
}


def make_text(domain: str, i: int, n_words: int = 120) -> str:
    rng = np.random.default_rng(i)
    return " ".join(rng.choice(WORDS[domain], n_words)) + f"\nline {i}\n"


def write_folder_corpus(root, n_docs=12):
    for domain in WORDS:
        (root / domain).mkdir(parents=True)
        for i in range(n_docs):
            (root / domain / f"doc{i}.txt").write_text(make_text(domain, i))
    return root


VOCAB = 300


def tiny_train_cfg(data: DataConfig, out_dir, **settings) -> Config:
    """A 2-layer run of a few steps on the tiny corpus; keywords as `with_train` takes them."""
    model = tiny_model_cfg(
        vocab_size=VOCAB,
        n_layers=2,
        n_heads=2,
        inter_dim=64,
        mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
        moe=dict(num_experts_per_tok=2, routed_scaling_factor=1.0, moe_inter_dim=16, bias_update_speed=1e-2),
    )
    cfg = Config(
        seed=1,
        model=model,
        data=dataclasses.replace(data),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        train=TrainConfig(max_steps=6, seq_len=32, micro_batch_size=4, grad_accum_steps=2, out_dir=str(out_dir)),
        cadence=CadenceConfig(log_interval=1, eval_interval=3, eval_batches=1, ckpt_interval=3, keep_last=2),
        logging=LoggingConfig(wandb_mode="disabled"),
    )
    return with_train(cfg, **settings)


def with_train(cfg: Config, **settings) -> Config:
    """`cfg` with fields of its train, cadence, performance and objective sections replaced by name (`objective=`
    names the objective), validated."""
    sections = {"train": {}, "cadence": {}, "performance": {}, "objective": {}}
    for key, value in settings.items():
        if key == "objective":
            sections["objective"]["name"] = value
            continue
        owner = next((s for s in sections if key in {f.name for f in dataclasses.fields(getattr(cfg, s))}), None)
        if owner is None:
            raise TypeError(f"no train/cadence/performance/objective field {key!r}")
        sections[owner][key] = value
    cfg = dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **kw) for s, kw in sections.items()})
    cfg.validate()
    return cfg


def rows(run_dir, kind: str = "train") -> list[dict]:
    """A run's metrics.jsonl rows of one kind ("train" or "eval")."""
    return [r for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]
