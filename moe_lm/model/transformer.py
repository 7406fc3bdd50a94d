"""Pre-norm decoder-only Transformer with DeepSeek-V3 MoE FFNs after the first `first_k_dense_replace` blocks.

    h = x + Attn(RMSNorm(x));  out = h + FFN(RMSNorm(h))     FFN = dense SwiGLU MLP, or MoE

Module names follow HF's DeepseekV3 / Glm4Moe models, so interop is a rename (see moe_lm/interop/hf.py).
Shape legend: B = batch, S = sequence, D = model dim, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_lm.config import ModelConfig
from moe_lm.model.attention import KVCache, attention_mask, build_attention, decode_mask, rope_cos_sin, rope_inv_freq
from moe_lm.model.layers import MLP, RMSNorm
from moe_lm.model.moe import MoE
from moe_lm.model.router import Router


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, S, V]
    aux_loss: torch.Tensor  # scalar: sum of the enabled balance losses over MoE layers (0 in eval)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = build_attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg.dim, cfg.inter_dim) if layer_id < cfg.first_k_dense_replace else MoE(cfg)

    def forward(self, x_BSD, cos, sin, mask, cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        h = x_BSD + self.self_attn(self.input_layernorm(x_BSD), cos, sin, mask, cache)
        if isinstance(self.mlp, MoE):
            y, aux = self.mlp(self.post_attention_layernorm(h))
        else:
            y, aux = self.mlp(self.post_attention_layernorm(h)), h.new_zeros(())
        return h + y, aux


class Transformer(nn.Module):
    """forward(tokens [B, S], prefix_len=None, cache=None) -> ModelOutput(logits [B, S, V], aux_loss).

    With a KVCache the tokens continue after the cached positions (incremental decoding for generation).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        rot_dim = self.layers[0].self_attn.rot_dim
        inv_freq, self.rope_factor = rope_inv_freq(rot_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, 0.0, cfg.init_std)

    def forward(
        self, tokens_BS: torch.Tensor, prefix_len: torch.Tensor | int | None = None, cache: KVCache | None = None
    ) -> ModelOutput:
        B, S = tokens_BS.shape
        start = cache.length if cache is not None else 0
        if start + S > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {start + S} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        x = self.embed_tokens(tokens_BS)
        positions = torch.arange(start, start + S, device=x.device)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype, self.rope_factor)
        if start == 0:
            mask = attention_mask(self.cfg.attn_mask, S, prefix_len, x.device)
        else:  # new tokens after a cached context (a prefix, if any, was the first chunk) see all of it
            mask = decode_mask(S, start, x.device)
        aux_loss = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            x, aux = layer(x, cos, sin, mask, cache)
            aux_loss = aux_loss + aux
        if cache is not None:
            cache.length += S
        return ModelOutput(self.lm_head(self.norm(x)), aux_loss)

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]

    def moe_layer_ids(self) -> list[int]:
        """Indices (in `layers`) of the MoE blocks; analytics and metrics name layers by them."""
        return [i for i, layer in enumerate(self.layers) if isinstance(layer.mlp, MoE)]

    def routers(self) -> list[Router]:
        """Every MoE router, in layer order (the bias update must reach all of them)."""
        return [moe.gate for moe in self.moe_layers()]
