"""Which of PyTorch's fused attention kernels runs MLA's causal attention, chosen per device from what each takes.

MLA's query/key heads (qk_nope + qk_rope: 192 in DeepSeek-V3) are wider than its value heads (v_head_dim: 128).
FlashAttention needs one head dim for q, k and v, so it runs MLA only with v padded with zero columns to the
query's width (a copy of v, and of the output's extra columns, per layer); cuDNN's and the memory-efficient kernels
take 192/128 as they are (on Hopper: docs/gpu.md §6). So, in order, the first that runs these shapes (forward and
backward, tried once on tiny tensors of the same device, dtype and head dims):
    CUDA: cuDNN (v as it is), FlashAttention (v padded), memory-efficient (v as it is), the math fallback
    CPU:  FlashAttention (v padded: the unfused math is 1.5x slower at the tiny preset), the math fallback
Equal head dims never pad. Only the causal forward of whole sequences chooses (mask None); an explicit mask
(decoding after a cache) leaves the choice to PyTorch, v padded as before for sequences (docs/benchmarks.md).
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

NAMES = {SDPBackend.CUDNN_ATTENTION: "cuDNN", SDPBackend.FLASH_ATTENTION: "FlashAttention",
         SDPBackend.EFFICIENT_ATTENTION: "memory-efficient", SDPBackend.MATH: "math"}  # fmt: skip
ORDER = {  # (backend, whether v must be padded to the query's width)
    "cuda": [(SDPBackend.CUDNN_ATTENTION, False), (SDPBackend.FLASH_ATTENTION, True),
             (SDPBackend.EFFICIENT_ATTENTION, False), (SDPBackend.MATH, False)],
    "cpu": [(SDPBackend.FLASH_ATTENTION, True), (SDPBackend.MATH, False)],
}  # fmt: skip


class Choice(NamedTuple):
    backend: SDPBackend
    pad_v: bool

    def describe(self, qk: int, v: int) -> str:
        padded = f"v padded from {v} to {qk}" if self.pad_v else f"v {v} as it is"
        return f"{NAMES[self.backend]} (q/k heads {qk}, {padded})" if qk != v else f"{NAMES[self.backend]} ({qk})"


_CHOSEN: dict[tuple, Choice] = {}


def mla_choice(device_type: str, dtype: torch.dtype, qk: int, v: int) -> Choice:
    """The kernel MLA's causal attention runs with on this kind of device, in this dtype, at these head dims.
    why a dict, not functools.cache: torch.compile traces through a cache's wrapper (it would trace the trial runs
    into the graph); a dict it reads, and the training loop fills it before the first compiled step."""
    key = (device_type, dtype, qk, v)
    if key not in _CHOSEN:
        # why: the trials run eagerly, should a compiled forward be the first to ask; torch.compiler.disable imports
        # torch._dynamo (2 s at the start of every process that never compiles), which a compiled forward has loaded
        choose = torch.compiler.disable(_choose) if "torch._dynamo" in sys.modules else _choose
        _CHOSEN[key] = choose(*key)
    return _CHOSEN[key]


def _choose(device_type: str, dtype: torch.dtype, qk: int, v: int) -> Choice:
    for backend, pad in ORDER.get(device_type, [(SDPBackend.MATH, False)]):
        pad = pad and v < qk
        if _runs(backend, device_type, dtype, qk, qk if pad else v):
            return Choice(backend, pad)
    return Choice(SDPBackend.MATH, False)


def _runs(backend: SDPBackend, device_type: str, dtype: torch.dtype, qk: int, v: int) -> bool:
    """Whether `backend` takes causal attention at these head dims, forward and backward (a kernel may accept a
    forward it has no backward for). why grad enabled here: the choice is kept for the process, and the first MLA
    forward may run under no_grad or inference_mode (generation, evaluation, analysis), where the backward would
    fail for every kernel: a process that trained after it ran the unfused math kernel."""
    with torch.inference_mode(False), torch.enable_grad():
        q, k = (torch.randn(1, 2, 16, qk, device=device_type, dtype=dtype, requires_grad=True) for _ in range(2))
        vv = torch.randn(1, 2, 16, v, device=device_type, dtype=dtype, requires_grad=True)
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, vv, is_causal=True).sum().backward()
        except RuntimeError:
            return False
    return True
