"""Multi-token prediction modules (DeepSeek-V3 §2.2): module k predicts the token k + 1 positions ahead.

For a window of tokens t_0 .. t_S (inputs t_0 .. t_{S-1}), with h^0 the main model's final hidden states:

    h'^k_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]        i = 0 .. S-k-1         [B, S-k, D]
    h^k    = TRM_k(h'^k)                                             one Transformer block, causal over i
    P^k_i  = OutHead(shared_head.norm(h^k_i))                        predicts t_{i+k+1}

Module k's inputs at position i are tokens up to t_{i+k} (the embedding) and positions <= i of depth k - 1, so its
prediction of t_{i+k+1} never sees that token: causality holds at every depth. Each depth is shorter by one
position because t_{i+k+1} must exist in the window.

Layout facts, as DeepSeek publishes its MTP module (`model.layers.61` of DeepSeek-V3) and as vLLM and SGLang serve
it: the projection's input is the embedding first, then the hidden state (the paper writes them the other way
round); h^0 is the main model's hidden state after its final RMSNorm (what the output head reads); h^k for k >= 1
is the block's output before the module's head norm. The embedding and the output head are the main model's own
(DeepSeek's checkpoint stores copies of them in each MTP layer; moe_lm.interop.hf writes and checks those).

Shape legend: B = batch, S = sequence, D = model dim.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lm.config import ModelConfig
from moe_lm.model.attention import KVCache
from moe_lm.model.block import Block
from moe_lm.model.layers import RMSNorm


class SharedHead(nn.Module):
    """The module's own norm before the main model's output head (named as DeepSeek's `shared_head`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, eps)


class MTPModule(Block):
    """One MTP depth: a decoder block whose input is eh_proj [enorm(embedding); hnorm(previous depth)].

    It is a Block (not a wrapper around one) because DeepSeek's checkpoint stores the block's tensors directly under
    the MTP layer (`model.layers.61.self_attn...` beside `model.layers.61.eh_proj`), so the names map one to one.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__(cfg, layer_id)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.shared_head = SharedHead(cfg.dim, cfg.norm_eps)

    def forward(
        self, h_prev_BSD, emb_BSD, cos, sin, mask=None, cache: KVCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h^{k-1} [B, S, D] and Emb(t_{i+k}) [B, S, D] at the same positions -> (h^k [B, S, D], aux loss)."""
        x = self.eh_proj(torch.cat((self.enorm(emb_BSD), self.hnorm(h_prev_BSD)), dim=-1))
        return super().forward(x, cos, sin, mask, cache)
