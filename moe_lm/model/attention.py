"""Attention: MLA (DeepSeek-V2/V3 multi-head latent attention) and GQA, rotary embeddings, the decoding mask.

Shape legend: B = batch, S = query length, L = key length, H = heads, D = model dim, R = rotary dims.

RoPE uses the rotate-half layout (HF's default). DeepSeek's published weights use the interleaved layout;
`moe_lm.interop.hf` permutes their rotary rows on import, which is exact because q.k is invariant under one
permutation applied to both.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from moe_lm.config import ModelConfig, RopeScalingConfig
from moe_lm.model.layers import RMSNorm
from moe_lm.model.sdpa_backend import mla_choice

# why fixed: DeepSeek-V3 and HF build the latent norms with the RMSNorm default eps, not the model's norm_eps.
LATENT_NORM_EPS = 1e-6


def rope_inv_freq(rot_dim: int, theta: float, scaling: RopeScalingConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [R/2] and the factor applied to cos/sin: plain RoPE, or YaRN (arXiv 2309.00071).

    YaRN keeps the dims that turn more than beta_fast times within the original context (high frequencies),
    divides the frequencies of those that turn fewer than beta_slow times by `factor`, and ramps linearly between.
    """
    freq_base = theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    if scaling.rope_type == "default":
        return 1.0 / freq_base, 1.0
    s = scaling

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times within the original context
        return (
            rot_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        )

    low = max(math.floor(dim_of(s.beta_fast)), 0)
    high = min(math.ceil(dim_of(s.beta_slow)), rot_dim - 1)
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    inv_freq = (1.0 / (s.factor * freq_base)) * ramp + (1.0 / freq_base) * (1 - ramp)
    if s.mscale and s.mscale_all_dim:
        factor = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        factor = yarn_mscale(s.factor)
    return inv_freq, factor


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, R] for integer positions [S] (computed in fp32), times `factor` (YaRN's attention factor)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., S, R] by position (rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class KVCache:
    """Per-layer tensors for incremental decoding: MLA keeps its compressed latent and rotary key (what makes
    MLA cheap to cache), GQA its keys and values. `length` counts the cached positions."""

    def __init__(self) -> None:
        self.layers: dict[int, tuple[torch.Tensor, ...]] = {}
        self.length = 0

    def extend(self, layer_id: int, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append new [B, ..., S, X] tensors along the sequence dim (-2) and return everything cached."""
        old = self.layers.get(layer_id)
        full = new if old is None else tuple(torch.cat((o, n), dim=-2) for o, n in zip(old, new, strict=True))
        self.layers[layer_id] = full
        return full

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions (speculative decoding drops what rejected drafts left behind)."""
        self.layers = {i: tuple(t[..., :length, :] for t in ts) for i, ts in self.layers.items()}
        self.length = min(self.length, length)


def decode_mask(S: int, start: int, device: torch.device) -> torch.Tensor:
    """[1, 1, S, start + S] mask for S new queries after `start` cached positions (causal, aligned at the end)."""
    q = start + torch.arange(S, device=device)
    return (torch.arange(start + S, device=device)[None, :] <= q[:, None])[None, None]


class ScaledDotProductAttention(nn.Module):
    """softmax(q k^T * scale + mask) v through PyTorch's fused kernels (mask None: causal). A module of its own, with
    no weights, because it is where the attention matrix arises: a forward hook on it sees q, k, v, the mask and the
    scale (the attention probe, moe_lm/experiments/attention_probe.py) without the model knowing."""

    def forward(self, q, k, v, mask: torch.Tensor | None, scale: float, enable_gqa: bool = False,
                backend: SDPBackend | None = None) -> torch.Tensor:  # fmt: skip
        """`backend`: the one kernel to run (None: PyTorch's choice)."""
        with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=enable_gqa
            )


class MLA(nn.Module):
    """Multi-head latent attention: low-rank query, compressed KV latent, decoupled shared rotary key."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0) -> None:
        super().__init__()
        m = cfg.mla
        self.layer_id = layer_id
        self.n_heads, self.nope, self.rope, self.v_dim = (
            cfg.n_heads,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
        )
        self.kv_rank = m.kv_lora_rank
        qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        H, D = cfg.n_heads, cfg.dim
        if m.q_lora_rank > 0:
            self.q_a_proj = nn.Linear(D, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * qk_head, bias=False)
        else:
            self.q_proj = nn.Linear(D, H * qk_head, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * m.v_head_dim, D, bias=False)
        self.scale = qk_head**-0.5
        r = cfg.rope_scaling
        if r.rope_type == "yarn" and r.mscale_all_dim:  # DeepSeek-V3 sharpens the softmax with the context
            self.scale *= yarn_mscale(r.factor, r.mscale_all_dim) ** 2
        self.rot_dim = m.qk_rope_head_dim
        self.sdpa = ScaledDotProductAttention()

    def forward(self, x_BSD, cos, sin, mask: torch.Tensor | None, cache: KVCache | None = None) -> torch.Tensor:
        """x [B, S, D] -> [B, S, D]; cos/sin [S, R] for the new positions."""
        B, S, _ = x_BSD.shape
        H = self.n_heads
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSD)))
        else:
            q = self.q_proj(x_BSD)
        # why in place: the rotary columns rotated into the projection's own output, one buffer, where a
        # concatenation of rope and nope parts copied every query column on every call
        q = q.view(B, S, H, self.nope + self.rope)
        q[..., self.nope :] = apply_rope(q[..., self.nope :].transpose(1, 2), cos, sin).transpose(1, 2)
        q = q.transpose(1, 2)  # [B, H, S, nope + rope]
        latent, k_rot = self.kv_a_proj_with_mqa(x_BSD).split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [B, S, C]
        # why one rotary key for all heads: it is what lets MLA cache only (latent, k_rot) per token.
        k_rot = apply_rope(k_rot.view(B, 1, S, self.rope), cos, sin)  # [B, 1, S, R]
        if cache is not None:
            latent, k_rot = cache.extend(self.layer_id, latent, k_rot)
        L = latent.shape[1]
        kv = self.kv_b_proj(latent).view(B, L, H, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = q.new_empty(B, H, L, self.nope + self.rope)  # each head's key: its own nope part, the shared rotary key
        k[..., : self.nope] = k_nope
        k[..., self.nope :] = k_rot
        qk = self.nope + self.rope
        if mask is None:  # a whole causal sequence: the kernel chosen for these head dims (sdpa_backend.py)
            choice = mla_choice(q.device.type, q.dtype, qk, self.v_dim)
            backend, width = choice.backend, qk if choice.pad_v else 0
        else:
            # why the padding: with an explicit mask PyTorch chooses; its fused kernels need one head dim for q, k
            # and v. Not for one decoded token (S = 1): there neither path wins at every cache length
            # (docs/benchmarks.md), and decoding stays as it was.
            backend, width = None, max(qk, self.v_dim) if S > 1 else 0
        # zero columns change no dot product (the scale is explicit) and give zero output columns, sliced off
        v = F.pad(v, (0, width - self.v_dim)) if width > self.v_dim else v
        out = self.sdpa(q, k, v, mask, self.scale, backend=backend)[..., : self.v_dim]
        return self.o_proj(out.transpose(1, 2).reshape(B, S, H * self.v_dim))


class GQA(nn.Module):
    """Grouped-query attention with partial RoPE on the first rotary dims of each head (GLM-4.5 style)."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0) -> None:
        super().__init__()
        g = cfg.gqa
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, g.n_kv_heads, g.head_dim
        self.rot_dim = int(g.head_dim * g.partial_rotary_factor)
        D = cfg.dim
        self.q_proj = nn.Linear(D, cfg.n_heads * g.head_dim, bias=False)
        self.k_proj = nn.Linear(D, g.n_kv_heads * g.head_dim, bias=False)
        self.v_proj = nn.Linear(D, g.n_kv_heads * g.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * g.head_dim, D, bias=False)
        self.scale = g.head_dim**-0.5
        self.sdpa = ScaledDotProductAttention()

    def forward(self, x_BSD, cos, sin, mask: torch.Tensor | None, cache: KVCache | None = None) -> torch.Tensor:
        """x [B, S, D] -> [B, S, D]; cos/sin [S, R] for the new positions."""
        B, S, _ = x_BSD.shape
        q = self.q_proj(x_BSD).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BSD).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BSD).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = (torch.cat((apply_rope(t[..., : self.rot_dim], cos, sin), t[..., self.rot_dim :]), -1) for t in (q, k))
        if cache is not None:
            k, v = cache.extend(self.layer_id, k, v)
        out = self.sdpa(q, k, v, mask, self.scale, self.n_kv_heads != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


def build_attention(cfg: ModelConfig, layer_id: int = 0) -> MLA | GQA:
    return MLA(cfg, layer_id) if cfg.attention == "mla" else GQA(cfg, layer_id)
