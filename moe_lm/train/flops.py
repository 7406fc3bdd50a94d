"""Model FLOPs per token and the peak FLOP/s that MFU divides by."""

from __future__ import annotations

import time

import torch

from moe_lm.config import ModelConfig
from moe_lm.model import count_params
from moe_lm.model.params import stack_params

# Dense bf16 peak per GPU (no sparsity), by device-name fragment.
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "4090": 165.0}


def train_flops_per_token(cfg: ModelConfig, seq_len: int, prefix_len: int = 0) -> float:
    """6 x active matmul parameters + attention score/value matmuls (PaLM's accounting, causal not halved), per
    token of a window, MTP modules included (depth k runs on seq_len - k of the seq_len positions). An
    encoder-decoder (needs `prefix_len` P) runs its encoder on P tokens and its decoder on seq_len - P + 1."""
    n = count_params(cfg)
    if cfg.attention == "mla":
        qk, v = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
    else:
        qk = v = cfg.gqa.head_dim
    score = 6.0 * cfg.n_heads * (qk + v)  # per (query, key) pair and layer
    head = cfg.vocab_size * cfg.dim
    if cfg.arch == "encdec":
        P, T = prefix_len, seq_len - prefix_len + 1
        if not 0 < P < seq_len:
            raise ValueError(f"an encoder-decoder's FLOPs need its prefix length, got {prefix_len}")
        encoder = P * (6.0 * stack_params(cfg, cfg.n_enc_layers, active=True) + cfg.n_enc_layers * score * P)
        decoder = T * (6.0 * (stack_params(cfg, cfg.n_layers, active=True, cross=True) + head))
        decoder += T * cfg.n_layers * score * (T + P)  # self-attention over T, cross-attention over P
        return (encoder + decoder) / seq_len
    active_matmul = n.active - head  # the embedding lookup is not a matmul
    flops = 6.0 * active_matmul + cfg.n_layers * score * seq_len
    D = cfg.mtp.depth
    if D:
        # one module: its own active parameters plus the shared output head, and one layer of attention
        module = 6.0 * (n.mtp_active / D + head) + score * seq_len
        flops += module * sum(max(seq_len - k, 0) for k in range(1, D + 1)) / seq_len
    return flops


def decode_flops_per_token(cfg: ModelConfig, seq_len: int, prefix_len: int) -> float:
    """Forward FLOPs of one generated token, on average over generating positions prefix_len .. seq_len - 1 after a
    prompt of prefix_len tokens with a KV cache: 2 x the matmul parameters it passes through + attention over its
    context (an encoder-decoder's decoder: its own tokens, and the P encoder positions by cross-attention). The
    prompt's own processing (prefill, or the encoder) is not included: it is paid once per prompt."""
    if cfg.attention == "mla":
        qk, v = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
    else:
        qk = v = cfg.gqa.head_dim
    score = 2.0 * cfg.n_heads * (qk + v)
    P, T = prefix_len, seq_len - prefix_len
    head = cfg.vocab_size * cfg.dim
    if cfg.arch == "encdec":
        return 2.0 * (stack_params(cfg, cfg.n_layers, active=True, cross=True) + head) + cfg.n_layers * score * (
            T / 2 + P
        )
    return 2.0 * (count_params(cfg).active - head) + cfg.n_layers * score * (P + T / 2)


def peak_flops(device: torch.device, configured_tflops: float = 0.0) -> tuple[float, str]:
    """Peak FLOP/s of one device and where the number comes from: configured, a known GPU's nominal bf16 peak, or
    on CPU the best of several fp32 matmul timings (0.0 for an unknown GPU: MFU is then not reported).

    why the best of several: a single short timing at start-up on a busy machine underestimates the peak, and an
    MFU above 100 % follows; the best of five 0.2 s runs is close to the machine's quiet rate.
    """
    if configured_tflops > 0:
        return configured_tflops * 1e12, f"logging.peak_tflops = {configured_tflops:g}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, tflops in GPU_PEAK_TFLOPS.items():
            if fragment in name:
                return tflops * 1e12, f"{name} nominal dense bf16 peak, {tflops:g} TFLOP/s"
        return 0.0, f"unknown GPU {name}: set logging.peak_tflops for MFU"
    a = torch.randn(1024, 1024)
    b = torch.randn(1024, 1024)
    a @ b
    best = 0.0
    for _ in range(5):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.2:
            a @ b
            n += 1
        best = max(best, 2 * 1024**3 * n / (time.perf_counter() - t0))
    return best, f"this CPU's measured fp32 matmul rate, {best / 1e12:.3f} TFLOP/s (best of 5)"


class Throughput:
    """Tokens/s and MFU of a step. A rate above the peak means the peak was underestimated: the peak is raised to
    it (and `note` says so once), so that MFU never reads above 100 %."""

    def __init__(self, flops_per_step: float, tokens_per_step: int, peak: float, note) -> None:
        self.flops_per_step, self.tokens_per_step, self.peak, self.note = flops_per_step, tokens_per_step, peak, note

    def __call__(self, seconds: float) -> dict[str, float]:
        achieved = self.flops_per_step / seconds
        if 0 < self.peak < achieved:
            self.note(
                f"warning: this step ran at {achieved / 1e12:.3f} TFLOP/s, above the peak MFU divides by "
                f"({self.peak / 1e12:.3f}); the peak is raised to it. Set logging.peak_tflops to the device's rate"
            )
            self.peak = achieved
        return {"tokens_per_s": self.tokens_per_step / seconds, "mfu": achieved / self.peak if self.peak else 0.0}
