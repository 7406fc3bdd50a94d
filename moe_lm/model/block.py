"""One pre-norm decoder block: h = x + Attn(RMSNorm(x)); out = h + FFN(RMSNorm(h)), FFN = dense SwiGLU or MoE.

Shape legend: B = batch, S = sequence, D = model dim.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lm.config import ModelConfig
from moe_lm.model.attention import KVCache, build_attention
from moe_lm.model.layers import MLP, RMSNorm
from moe_lm.model.moe import MoE


class Block(nn.Module):
    """Layers before `first_k_dense_replace` have a dense MLP, the others (MTP blocks included) an MoE FFN, as in
    HF's DeepseekV3 (module names follow it)."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = build_attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg.dim, cfg.inter_dim) if layer_id < cfg.first_k_dense_replace else MoE(cfg)

    def forward(self, x_BSD, cos, sin, mask, cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, D] -> (out [B, S, D], this block's balance loss)."""
        h = x_BSD + self.self_attn(self.input_layernorm(x_BSD), cos, sin, mask, cache)
        if isinstance(self.mlp, MoE):
            y, aux = self.mlp(self.post_attention_layernorm(h))
        else:
            y, aux = self.mlp(self.post_attention_layernorm(h)), h.new_zeros(())
        return h + y, aux
