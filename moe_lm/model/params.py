"""The decoder-only Transformer's sizes from the config alone: parameters (total, and active per token: shared +
K routed experts) and FLOPs per token of training and of decoding.

As DeepSeek-V3 reports its sizes (671 B total, 37 B active, "plus 14 B of MTP modules"), `total` and `active` are
the main model's; the MTP modules' own parameters (not the embedding and head they share) are counted apart.
Other architectures register their own counts (moe_lm/model/architectures.py).
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


def stack_params(cfg: ModelConfig, n_layers: int, active: bool = False) -> int:
    """Parameters of n blocks, the first first_k_dense_replace of them dense (all of them, or only those one token
    passes through if `active`)."""
    D, m = cfg.dim, cfg.moe
    expert = 3 * D * m.moe_inter_dim
    n_routed = m.num_experts_per_tok if active else m.n_routed_experts
    moe_ffn = D * m.n_routed_experts + (n_routed + m.n_shared_experts) * expert
    n_dense = min(cfg.first_k_dense_replace, n_layers)
    per_block = attention_params(cfg) + 2 * D
    return n_layers * per_block + n_dense * 3 * D * cfg.inter_dim + (n_layers - n_dense) * moe_ffn


def decoder_params(cfg: ModelConfig) -> ParamCount:
    D, m = cfg.dim, cfg.moe
    expert = 3 * D * m.moe_inter_dim
    outside = 2 * cfg.vocab_size * D + D  # embedding, untied head, final norm
    total = outside + stack_params(cfg, cfg.n_layers)
    active = outside + stack_params(cfg, cfg.n_layers, active=True)
    # an MTP module: enorm, hnorm, eh_proj [D, 2D], the head norm, and one MoE block
    mtp = dataclasses.replace(cfg, first_k_dense_replace=0)
    module, module_active = (3 * D + 2 * D * D + stack_params(mtp, 1, a) for a in (False, True))
    depth = cfg.mtp.depth
    return ParamCount(total, active, expert, depth * module, depth * module_active)


def score_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs of attention's score and value matmuls per (query, key) pair and layer."""
    if cfg.attention == "mla":
        qk, v = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
    else:
        qk = v = cfg.gqa.head_dim
    return 2.0 * cfg.n_heads * (qk + v)


def decoder_train_flops(cfg: ModelConfig, seq_len: int, prefix_len: int = 0) -> float:
    """6 x active matmul parameters + attention score/value matmuls (PaLM's accounting, causal not halved), per
    token of a window, MTP modules included (depth k runs on seq_len - k of the seq_len positions)."""
    n = decoder_params(cfg)
    score = 3 * score_flops(cfg)  # forward and backward
    head = cfg.vocab_size * cfg.dim
    active_matmul = n.active - head  # the embedding lookup is not a matmul
    flops = 6.0 * active_matmul + cfg.n_layers * score * seq_len
    D = cfg.mtp.depth
    if D:
        # one module: its own active parameters plus the shared output head, and one layer of attention
        module = 6.0 * (n.mtp_active / D + head) + score * seq_len
        flops += module * sum(max(seq_len - k, 0) for k in range(1, D + 1)) / seq_len
    return flops


def decoder_decode_flops(cfg: ModelConfig, seq_len: int, prefix_len: int) -> float:
    """Forward FLOPs of one generated token, on average over generating positions prefix_len .. seq_len - 1 after a
    prompt of prefix_len tokens with a KV cache: 2 x the matmul parameters it passes through + attention over its
    context. The prompt's own processing (prefill) is not included: it is paid once per prompt."""
    P, T = prefix_len, seq_len - prefix_len
    head = cfg.vocab_size * cfg.dim
    return 2.0 * (decoder_params(cfg).active - head) + cfg.n_layers * score_flops(cfg) * (P + T / 2)
