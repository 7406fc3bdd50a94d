"""An encoder-decoder variant (RedLLM-style, arXiv 2510.26622), for the experiment that compares it with the
decoder-only model at equal parameters and at twice the parameters (`encdec`, which owns it: docs/experiments.md §5).

A window's first P tokens (the prefix, `prefix_len`) go to the encoder: n_enc_layers blocks with bidirectional
self-attention. The decoder reads t_{P-1} .. t_{S-1} and predicts t_P .. t_S: n_layers blocks, each with causal
self-attention, cross-attention over the encoder's output, and the FFN (dense or MoE by the same rule as the
decoder-only model, counted within each stack). RoPE is applied in every attention with one continuous position
axis (encoder positions 0 .. P-1, decoder positions P-1 .. S-1), as RedLLM does; the embedding is shared by both
stacks, the output head untied. So the labels are exactly the prefix-LM objective's (objectives.py here) and no
target is ever visible to the encoder. forward returns logits for every input position (zeros before P-1,
which the objective leaves unlabelled) so the training and evaluation code serve both architectures unchanged.

Shape legend: B = batch, S = window, P = prefix, T = S - P + 1 decoder positions, D = model dim, V = vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_lm.config import Config, ConfigError, ModelConfig
from moe_lm.model.architectures import Architecture, register_architecture
from moe_lm.model.attention import GQA, apply_rope, rope_cos_sin, rope_inv_freq
from moe_lm.model.block import Block
from moe_lm.model.layers import KeepsFp32Buffers, RMSNorm
from moe_lm.model.moe import MoE
from moe_lm.model.params import ParamCount, attention_params, score_flops, stack_params
from moe_lm.model.router import Router
from moe_lm.model.transformer import ModelOutput, _init_weights


class CrossAttention(GQA):
    """GQA attention from decoder queries to encoder keys/values (GQA's projections), partial RoPE at each side's
    own positions."""

    def forward(self, x_BTD, enc_BPD, q_rope, k_rope) -> torch.Tensor:
        """x [B, T, D] attends to every encoder position enc [B, P, D]; *_rope = (cos, sin) of each side."""
        B, T, _ = x_BTD.shape
        P = enc_BPD.shape[1]
        q = self.q_proj(x_BTD).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(enc_BPD).view(B, P, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(enc_BPD).view(B, P, self.n_kv_heads, self.head_dim).transpose(1, 2)
        r = self.rot_dim
        q = torch.cat((apply_rope(q[..., :r], *q_rope), q[..., r:]), -1)
        k = torch.cat((apply_rope(k[..., :r], *k_rope), k[..., r:]), -1)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class DecoderBlock(Block):
    """A decoder block with cross-attention between self-attention and the FFN (pre-norm, residual)."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__(cfg, layer_id)
        self.cross_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.cross_attn = CrossAttention(cfg)

    def forward(self, x_BTD, cos, sin, enc_BPD, enc_rope) -> tuple[torch.Tensor, torch.Tensor]:
        h = x_BTD + self.self_attn(self.input_layernorm(x_BTD), cos, sin, None)  # causal
        h = h + self.cross_attn(self.cross_layernorm(h), enc_BPD, (cos, sin), enc_rope)
        if isinstance(self.mlp, MoE):
            y, aux = self.mlp(self.post_attention_layernorm(h))
        else:
            y, aux = self.mlp(self.post_attention_layernorm(h)), h.new_zeros(())
        return h + y, aux


class EncoderDecoder(KeepsFp32Buffers):
    """forward(tokens [B, S], prefix_len=P) -> ModelOutput(logits [B, S, V]: the decoder's at positions P-1 ..
    S-1, zeros before; aux_loss; hidden)."""

    fp32_buffers = ("inv_freq",)  # as the Transformer's
    window_aligned_routing = False  # the encoder routes the prefix, the decoder positions P-1 .. S-1

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg  # validated where it was loaded (config/loading.py, train/loop.py, interop/hf.py)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.encoder = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_enc_layers))
        self.enc_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.layers = nn.ModuleList(DecoderBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList()  # the training loop's interface: no MTP here
        inv_freq, self.rope_factor = rope_inv_freq(self.layers[0].self_attn.rot_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        _init_weights(self, cfg.init_std)

    def forward(
        self, tokens_BS: torch.Tensor, prefix_len: int | None = None, cache=None, mtp: bool = False, logits: bool = True
    ):
        if not logits:
            raise ValueError("the encoder-decoder always computes its logits (performance.loss_chunk must be 0)")
        if prefix_len is None or cache is not None:
            raise ValueError("the encoder-decoder model reads whole windows with a prefix_len (its encoder's input)")
        B, S = tokens_BS.shape
        P = int(prefix_len)
        if not 0 < P <= S:
            raise ValueError(f"prefix_len {P} must be in 1..{S}")
        x = self.embed_tokens(tokens_BS)
        positions = torch.arange(S, device=x.device)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype, self.rope_factor)
        aux_loss = x.new_zeros((), dtype=torch.float32)
        enc = x[:, :P]
        everywhere = torch.ones(1, 1, P, P, dtype=torch.bool, device=x.device)  # bidirectional
        for block in self.encoder:
            enc, aux = block(enc, cos[:P], sin[:P], everywhere)
            aux_loss = aux_loss + aux
        enc = self.enc_norm(enc)
        h = x[:, P - 1 :]  # the decoder starts from the prefix's last token, at its position
        dec_cos, dec_sin = cos[P - 1 :], sin[P - 1 :]
        for block in self.layers:
            h, aux = block(h, dec_cos, dec_sin, enc, (cos[:P], sin[:P]))
            aux_loss = aux_loss + aux
        hidden = self.norm(h)
        logits = self.lm_head(hidden)
        logits = torch.cat((logits.new_zeros(B, P - 1, logits.shape[-1]), logits), dim=1)
        return ModelOutput(logits, aux_loss, hidden)

    def blocks(self) -> list[Block]:
        return [*self.encoder, *self.layers]

    def moe_layers(self) -> list[MoE]:
        return [block.mlp for block in self.blocks() if isinstance(block.mlp, MoE)]

    def moe_layer_ids(self) -> list[int]:
        """Encoder blocks are layers 0 .. n_enc_layers - 1, decoder blocks follow."""
        return [i for i, block in enumerate(self.blocks()) if isinstance(block.mlp, MoE)]

    def routers(self) -> list[Router]:
        return [moe.gate for moe in self.moe_layers()]


# ------------------------------------------------------------------------------------ sizes and registration


def cross_params(cfg: ModelConfig, n_layers: int) -> int:
    """The decoder blocks' cross-attentions and their norms."""
    return n_layers * (attention_params(cfg) + cfg.dim)


def encdec_params(cfg: ModelConfig) -> ParamCount:
    D = cfg.dim
    outside = 2 * cfg.vocab_size * D + 2 * D  # embedding, untied head, the two final norms
    stacks = cross_params(cfg, cfg.n_layers)
    total = outside + stacks + stack_params(cfg, cfg.n_layers) + stack_params(cfg, cfg.n_enc_layers)
    active = outside + stacks + stack_params(cfg, cfg.n_layers, True) + stack_params(cfg, cfg.n_enc_layers, True)
    return ParamCount(total, active, 3 * D * cfg.moe.moe_inter_dim)


def encdec_train_flops(cfg: ModelConfig, seq_len: int, prefix_len: int) -> float:
    """Training FLOPs per token of a window: the encoder on the P prefix tokens, the decoder on seq_len - P + 1
    (self-attention over those, cross-attention over P)."""
    P, T = prefix_len, seq_len - prefix_len + 1
    if not 0 < P < seq_len:
        raise ValueError(f"an encoder-decoder's FLOPs need its prefix length, got {prefix_len}")
    score, head = 3 * score_flops(cfg), cfg.vocab_size * cfg.dim
    encoder = P * (6.0 * stack_params(cfg, cfg.n_enc_layers, active=True) + cfg.n_enc_layers * score * P)
    decoder = T * 6.0 * (stack_params(cfg, cfg.n_layers, active=True) + cross_params(cfg, cfg.n_layers) + head)
    decoder += T * cfg.n_layers * score * (T + P)
    return (encoder + decoder) / seq_len


def encdec_decode_flops(cfg: ModelConfig, seq_len: int, prefix_len: int) -> float:
    """Forward FLOPs per generated token after a prompt of P (the encoder's input, paid once): the decoder's
    matmuls and attention over its own tokens and, by cross-attention, the P encoder positions."""
    P, T = prefix_len, seq_len - prefix_len
    matmul = stack_params(cfg, cfg.n_layers, active=True) + cross_params(cfg, cfg.n_layers) + cfg.vocab_size * cfg.dim
    return 2.0 * matmul + cfg.n_layers * score_flops(cfg) * (T / 2 + P)


def _rule(cfg: Config) -> None:
    m, why = cfg.model, None
    if m.n_enc_layers <= 0:
        key, why = "model.n_enc_layers", "must be positive for model.arch=encdec"
    elif m.attention != "gqa":
        key, why = "model.attention", "must be gqa for model.arch=encdec (GQA cross-attention)"
    elif m.mtp.depth:
        key, why = "model.mtp.depth", "must be 0 for model.arch=encdec"
    elif m.attn_mask != "causal":
        key, why = "model.attn_mask", "must be causal for model.arch=encdec (its encoder is bidirectional, its "
        "decoder causal, by design)"
    elif cfg.objective.name != "prefix_lm":
        key, why = "model.arch", "= encdec needs objective.name=prefix_lm (the encoder reads the prefix, the decoder "
        "predicts the rest)"
    if why:
        raise ConfigError(f"{key} {why}")


def register() -> None:
    # chunked_loss=False: the encoder-decoder always computes its logits (the plain loss, whatever loss_chunk says)
    arch = Architecture(
        EncoderDecoder, encdec_params, encdec_train_flops, encdec_decode_flops, reads_prefix=True, chunked_loss=False
    )
    register_architecture("encdec", arch, _rule)
