"""Model FLOPs per token and the peak FLOP/s that MFU divides by."""

from __future__ import annotations

import time

import torch

from moe_lm.config import ModelConfig
from moe_lm.model import count_params

# Dense bf16 peak per GPU (no sparsity), by device-name fragment.
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "4090": 165.0}


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 x active matmul parameters + attention score/value matmuls (PaLM's accounting, causal not halved)."""
    active_matmul = count_params(cfg).active - cfg.vocab_size * cfg.dim  # the embedding lookup is not a matmul
    if cfg.attention == "mla":
        qk, v = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
    else:
        qk = v = cfg.gqa.head_dim
    return 6.0 * active_matmul + 6.0 * cfg.n_layers * seq_len * cfg.n_heads * (qk + v)


def peak_flops(device: torch.device, configured_tflops: float = 0.0) -> float:
    """Peak FLOP/s of one device: configured, known GPU, or measured fp32 matmul throughput on CPU."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, tflops in GPU_PEAK_TFLOPS.items():
            if fragment in name:
                return tflops * 1e12
        return 0.0  # unknown GPU: MFU is reported as 0 unless logging.peak_tflops is set
    a = torch.randn(1024, 1024)
    b = torch.randn(1024, 1024)
    a @ b
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.3:
        a @ b
        n += 1
    return 2 * 1024**3 * n / (time.perf_counter() - t0)
