"""Parameter counts from the config alone: total, and active per token (shared + K routed experts).

As DeepSeek-V3 reports its sizes (671 B total, 37 B active, "plus 14 B of MTP modules"), `total` and `active` are
the main model's; the MTP modules' own parameters (not the embedding and head they share) are counted apart.
"""

from __future__ import annotations

import dataclasses
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


def stack_params(cfg: ModelConfig, n_layers: int, active: bool = False, cross: bool = False) -> int:
    """Parameters of n blocks, the first first_k_dense_replace of them dense (all of them, or only those one token
    passes through if `active`); `cross`: each block also has a cross-attention and its norm (encdec decoder)."""
    D, m = cfg.dim, cfg.moe
    expert = 3 * D * m.moe_inter_dim
    n_routed = m.num_experts_per_tok if active else m.n_routed_experts
    moe_ffn = D * m.n_routed_experts + (n_routed + m.n_shared_experts) * expert
    n_dense = min(cfg.first_k_dense_replace, n_layers)
    per_block = attention_params(cfg) + 2 * D + (attention_params(cfg) + D if cross else 0)
    return n_layers * per_block + n_dense * 3 * D * cfg.inter_dim + (n_layers - n_dense) * moe_ffn


def count_params(cfg: ModelConfig) -> ParamCount:
    D, m = cfg.dim, cfg.moe
    expert = 3 * D * m.moe_inter_dim
    encdec = cfg.arch == "encdec"
    outside = 2 * cfg.vocab_size * D + D + (D if encdec else 0)  # embedding, untied head, final norm(s)
    total, active = outside, outside
    for n_layers, cross in ((cfg.n_layers, encdec), (cfg.n_enc_layers if encdec else 0, False)):
        total += stack_params(cfg, n_layers, cross=cross)
        active += stack_params(cfg, n_layers, active=True, cross=cross)
    # an MTP module: enorm, hnorm, eh_proj [D, 2D], the head norm, and one MoE block
    mtp = dataclasses.replace(cfg, first_k_dense_replace=0)
    module, module_active = (3 * D + 2 * D * D + stack_params(mtp, 1, a) for a in (False, True))
    depth = cfg.mtp.depth
    return ParamCount(total, active, expert, depth * module, depth * module_active)
