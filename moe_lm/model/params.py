"""Parameter counts from the config alone: total, and active per token (shared + K routed experts).

As DeepSeek-V3 reports its sizes (671 B total, 37 B active, "plus 14 B of MTP modules"), `total` and `active` are
the main model's; the MTP modules' own parameters (not the embedding and head they share) are counted apart.
"""

from __future__ import annotations

from typing import NamedTuple

from moe_lm.config import ModelConfig


class ParamCount(NamedTuple):
    total: int
    active: int  # parameters a token passes through: all but the (E - K) routed experts it skips
    routed_expert: int  # one routed expert
    mtp_total: int = 0  # all MTP modules' own parameters (projection, norms, block)
    mtp_active: int = 0  # of those, what one token passes through at every depth


def attention_params(cfg: ModelConfig) -> int:
    D, H = cfg.dim, cfg.n_heads
    if cfg.attention == "mla":
        m = cfg.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = D * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * H * qk if m.q_lora_rank else D * H * qk
        kv = (
            D * (m.kv_lora_rank + m.qk_rope_head_dim)
            + m.kv_lora_rank
            + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim)
        )
        return q + kv + H * m.v_head_dim * D
    g = cfg.gqa
    return 2 * D * H * g.head_dim + 2 * D * g.n_kv_heads * g.head_dim


def count_params(cfg: ModelConfig) -> ParamCount:
    D, m = cfg.dim, cfg.moe
    n_moe = cfg.n_layers - cfg.first_k_dense_replace
    expert = 3 * D * m.moe_inter_dim
    per_block = attention_params(cfg) + 2 * D  # + the two block norms
    dense_ffn = 3 * D * cfg.inter_dim
    moe_ffn = D * m.n_routed_experts + m.n_routed_experts * expert + m.n_shared_experts * expert
    total = (
        2 * cfg.vocab_size * D  # embedding and untied head
        + D  # final norm
        + cfg.n_layers * per_block
        + cfg.first_k_dense_replace * dense_ffn
        + n_moe * moe_ffn
    )
    skipped = (m.n_routed_experts - m.num_experts_per_tok) * expert  # routed experts one token does not use
    active = total - n_moe * skipped
    # an MTP module: enorm, hnorm, eh_proj [D, 2D], the head norm, and one MoE block
    mtp_module = 3 * D + 2 * D * D + per_block + moe_ffn
    depth = cfg.mtp.depth
    return ParamCount(total, active, expert, depth * mtp_module, depth * (mtp_module - skipped))
