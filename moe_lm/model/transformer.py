"""Pre-norm decoder-only Transformer with DeepSeek-V3 MoE FFNs after the first `first_k_dense_replace` blocks.

    h = x + Attn(RMSNorm(x));  out = h + FFN(RMSNorm(h))     FFN = dense SwiGLU MLP, or MoE

Module names follow HF's DeepseekV3 / Glm4Moe models, so interop is a rename (see moe_lm/interop/hf.py).
Shape legend: B = batch, S = sequence, D = model dim, V = vocabulary.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from moe_lm.config import ModelConfig
from moe_lm.model.attention import KVCache, decode_mask, rope_cos_sin, rope_inv_freq
from moe_lm.model.block import Block
from moe_lm.model.layers import KeepsFp32Buffers, RMSNorm
from moe_lm.model.masks import mask_provider
from moe_lm.model.moe import MoE
from moe_lm.model.mtp import MTPModule
from moe_lm.model.router import Router


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, S, V] (None with forward(..., logits=False))
    aux_loss: (
        torch.Tensor
    )  # scalar: sum of the enabled balance losses over MoE layers, MTP blocks' included (0 in eval)
    hidden: torch.Tensor  # [B, S, D] the final hidden states after the last norm (what lm_head reads; MTP's h^0)
    # with forward(..., mtp=True): per MTP depth k = 1..D, logits [B, S - k, V]; position i predicts token i + k + 1
    mtp_logits: list[torch.Tensor] = field(default_factory=list)
    # ... and the states the head reads for them [B, S - k, D] (after shared_head.norm)
    mtp_hidden: list[torch.Tensor] = field(default_factory=list)


class Transformer(KeepsFp32Buffers):
    """forward(tokens [B, S], prefix_len=None, cache=None, mtp=False) -> ModelOutput(logits [B, S, V], aux_loss, ...).

    `prefix_len` goes to the attention mask's provider (model.attn_mask; the causal mask ignores it).

    With a KVCache the tokens continue after the cached positions (incremental decoding for generation). With
    `model.mtp.depth` = D > 0 the model also holds D multi-token-prediction modules (`mtp`), which run only when
    forward is asked for them (`mtp=True`, training and evaluation); the main model's logits never depend on them.
    """

    # why: RoPE frequencies rounded to bf16 turn positions in the thousands into angles off by radians
    fp32_buffers = ("inv_freq",)
    # every MoE layer routes the window's positions 0, 1, ... in order (an MTP depth k the first S - k), so what it
    # chose can be matched to the window's tokens (evaluation's repetition counts)
    window_aligned_routing = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg  # validated where it was loaded (config/loading.py, train/loop.py, interop/hf.py)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        rot_dim = self.layers[0].self_attn.rot_dim
        inv_freq, self.rope_factor = rope_inv_freq(rot_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        _init_weights(self, cfg.init_std)
        # why after the main model's initialisation: its weights are then the same at every MTP depth (same seed),
        # so runs with and without MTP start from the same main model. Module k is layer n_layers + k - 1, as
        # DeepSeek numbers it in its checkpoints.
        self.mtp = nn.ModuleList(MTPModule(cfg, cfg.n_layers + k) for k in range(cfg.mtp.depth))
        _init_weights(self.mtp, cfg.init_std)

    def forward(
        self,
        tokens_BS: torch.Tensor,
        prefix_len: torch.Tensor | int | None = None,
        cache: KVCache | None = None,
        mtp: bool = False,
        logits: bool = True,
    ) -> ModelOutput:
        """logits=False skips the output head (logits None, mtp_logits empty): a chunked loss reads `hidden` and
        `mtp_hidden` with lm_head's weight instead (performance.loss_chunk)."""
        B, S = tokens_BS.shape
        start = cache.length if cache is not None else 0
        if start + S > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {start + S} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        x = self.embed_tokens(tokens_BS)
        positions = torch.arange(start, start + S, device=x.device)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype, self.rope_factor)
        n, provider = len(self.layers), mask_provider(self.cfg.attn_mask)
        if start == 0:
            masks = provider.layer_masks(S, prefix_len, x.device, self.cfg.n_heads, n)
        elif provider.decodes:  # new tokens after a cached context (a prefix was the first chunk) see all of it
            masks = [decode_mask(S, start, x.device)] * n
        else:
            raise ValueError(f"attn_mask={self.cfg.attn_mask} models are encoders: no incremental decoding")
        aux_loss = x.new_zeros((), dtype=torch.float32)
        for layer, mask in zip(self.layers, masks, strict=True):
            x, aux = layer(x, cos, sin, mask, cache)
            aux_loss = aux_loss + aux
        if cache is not None:
            cache.length += S
        hidden = self.norm(x)
        out = ModelOutput(self.lm_head(hidden) if logits else None, aux_loss, hidden)
        if mtp and len(self.mtp):
            if cache is not None:
                raise ValueError("forward(mtp=True) runs the MTP modules over whole windows, not with a KVCache")
            out.mtp_hidden, mtp_aux = self.mtp_states(tokens_BS, hidden, cos, sin)
            out.mtp_logits = [self.lm_head(h) for h in out.mtp_hidden] if logits else []
            out.aux_loss = out.aux_loss + mtp_aux
        return out

    def mtp_states(self, tokens_BS, hidden_BSD, cos, sin) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Every MTP depth over a window: ([the head's input [B, S - k, D] for k = 1..D], their blocks' balance
        loss)."""
        S = tokens_BS.shape[1]
        states, aux_loss, h = [], hidden_BSD.new_zeros((), dtype=torch.float32), hidden_BSD
        for k, module in enumerate(self.mtp, start=1):
            n = S - k  # positions i whose target t_{i+k+1} lies in the window
            if n <= 0:
                break
            h, aux = module(h[:, :n], self.embed_tokens(tokens_BS[:, k : k + n]), cos[:n], sin[:n])
            states.append(module.shared_head.norm(h))
            aux_loss = aux_loss + aux
        return states, aux_loss

    def blocks(self) -> list[Block]:
        """The decoder blocks, then the MTP modules' blocks (numbered n_layers, n_layers + 1, ...)."""
        return [*self.layers, *self.mtp]

    def moe_layers(self) -> list[MoE]:
        """Every MoE FFN, MTP blocks' included: what expert parallelism shards and checkpoints save per expert."""
        return [block.mlp for block in self.blocks() if isinstance(block.mlp, MoE)]

    def moe_layer_ids(self) -> list[int]:
        """Layer numbers of the MoE blocks (MTP module k is n_layers + k - 1); analytics and metrics name layers by
        them."""
        return [i for i, block in enumerate(self.blocks()) if isinstance(block.mlp, MoE)]

    def routers(self) -> list[Router]:
        """Every MoE router in layer order, MTP blocks' included (the bias update must reach all of them)."""
        return [moe.gate for moe in self.moe_layers()]


def _init_weights(module: nn.Module, std: float) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, 0.0, std)


def build_by_layer(cfg: ModelConfig, seed: int, keep: Callable[[str], bool] | None = None) -> Transformer:
    """The Transformer with each part built and initialised from its own seed, derived from (seed, part): the
    embedding ("embed_tokens"), each block ("layers.i"), the final norm and output head ("head"), each MTP module
    ("mtp.k"). A part's weights are then the same whichever other parts are built, so a pipeline stage builds only
    its own (`keep(part)`); the others stay on the meta device (no memory), except their MoE routers, whose bias and
    token counts are the balancing's state on every rank (E x D weights each). These are not the weights
    `Transformer(cfg)` draws from one generator in turn: a run uses one or the other (train.layer_seeds)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    for part, make in _parts(model, cfg):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_part_seed(seed, part))
            if keep is None or keep(part):
                _init_weights(make(), cfg.init_std)
            else:  # on the meta device but for the routers
                for block in _blocks_of(model, part):
                    if isinstance(block.mlp, MoE):
                        block.mlp.gate = Router(cfg.dim, cfg.moe, cfg.init_std)
    inv_freq, _ = rope_inv_freq(model.layers[0].self_attn.rot_dim, cfg.rope_theta, cfg.rope_scaling)
    model.register_buffer("inv_freq", inv_freq, persistent=False)
    return model


def _parts(model: Transformer, cfg: ModelConfig) -> list[tuple[str, Callable[[], nn.Module]]]:
    """(part, build it in place and return it), in the model's order."""

    def embedding() -> nn.Module:
        model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        return model.embed_tokens

    def block(i: int) -> nn.Module:
        model.layers[i] = Block(cfg, i)
        return model.layers[i]

    def head() -> nn.Module:
        model.norm, model.lm_head = RMSNorm(cfg.dim, cfg.norm_eps), nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        return nn.ModuleList([model.norm, model.lm_head])

    def mtp(k: int) -> nn.Module:
        model.mtp[k] = MTPModule(cfg, cfg.n_layers + k)
        return model.mtp[k]

    return [
        ("embed_tokens", embedding),
        *((f"layers.{i}", functools.partial(block, i)) for i in range(cfg.n_layers)),
        ("head", head),
        *((f"mtp.{k}", functools.partial(mtp, k)) for k in range(cfg.mtp.depth)),
    ]


def _blocks_of(model: Transformer, part: str) -> list[Block]:
    kind, _, index = part.partition(".")
    return [getattr(model, kind)[int(index)]] if kind in ("layers", "mtp") else []


def _part_seed(seed: int, part: str) -> int:
    """A 63-bit seed for one part of one run: independent of the other parts and of the process."""
    return int.from_bytes(hashlib.sha256(f"moe-lm/{seed}/{part}".encode()).digest()[:8], "little") >> 1
