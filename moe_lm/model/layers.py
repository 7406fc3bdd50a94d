"""Small building blocks shared by attention, MoE and the Transformer: RMSNorm, the SwiGLU MLP, and fp32 buffers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (as DeepSeek-V3 and HF do) and returned in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate x) * up x). Dense layers and the shared experts use it."""

    def __init__(self, dim: int, inter_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter_dim, bias=False)
        self.up_proj = nn.Linear(dim, inter_dim, bias=False)
        self.down_proj = nn.Linear(inter_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class KeepsFp32Buffers(nn.Module):
    """A module whose buffers named in `fp32_buffers` stay fp32 when the module is cast (model.to(bfloat16), which
    DeepSpeed's bf16 mode and user code do): they move with it, but are never rounded."""

    fp32_buffers: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        kept = {name: self._buffers.pop(name) for name in self.fp32_buffers if name in self._buffers}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, buffer in kept.items():
                moved = fn(buffer)
                self._buffers[name] = buffer.to(device=moved.device, dtype=torch.float32)
        return self
