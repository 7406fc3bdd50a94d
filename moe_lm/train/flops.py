"""The peak FLOP/s that MFU divides by, and a step's tokens/s and MFU (the model's FLOPs per token come from
moe_lm.model.train_flops_per_token)."""

from __future__ import annotations

import time

import torch

# Dense bf16 peak per GPU (no sparsity), by device-name fragment.
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "4090": 165.0}


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

    def __init__(self, flops_per_step: float, tokens_per_step: int, peak: float, note, source: str = "") -> None:
        self.flops_per_step, self.tokens_per_step, self.peak, self.note = flops_per_step, tokens_per_step, peak, note
        self.source = source  # where the peak comes from, for the run's header line

    def __call__(self, seconds: float) -> dict[str, float]:
        achieved = self.flops_per_step / seconds
        if 0 < self.peak < achieved:
            self.note(
                f"warning: this step ran at {achieved / 1e12:.3f} TFLOP/s, above the peak MFU divides by "
                f"({self.peak / 1e12:.3f}); the peak is raised to it. Set logging.peak_tflops to the device's rate"
            )
            self.peak = achieved
        return {"tokens_per_s": self.tokens_per_step / seconds, "mfu": achieved / self.peak if self.peak else 0.0}
