"""The one tiny model config every test builds on (pytest tests and the scripts run under `deepspeed` alike)."""

from __future__ import annotations

import dataclasses

from moe_lm.config import GQAConfig, MLAConfig, ModelConfig, MoEConfig

TINY_MOE = dict(
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    moe_inter_dim=24,
)


def tiny_model_cfg(attention: str = "mla", moe: dict | None = None, **fields) -> ModelConfig:
    """A 3-layer MLA (or GQA) MoE model of a few thousand parameters; `moe` overrides fields of the MoE section
    (`moe=dict(n_group=1)`), other keywords override ModelConfig fields."""
    base = dict(
        vocab_size=97,
        dim=32,
        n_layers=3,
        n_heads=4,
        inter_dim=48,
        first_k_dense_replace=1,
        attention=attention,
        max_seq_len=64,
        mla=MLAConfig(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
        gqa=GQAConfig(n_kv_heads=2, head_dim=8, partial_rotary_factor=0.5),
        moe=MoEConfig(**{**TINY_MOE, **(moe or {})}),
    )
    return ModelConfig(**{**base, **fields})


def replace_moe(cfg: ModelConfig, **kw) -> ModelConfig:
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **kw))
