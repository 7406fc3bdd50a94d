"""Benchmark the MoE layer against a dense SwiGLU of equal active FLOPs and HF's DeepseekV3MoE, side by side.

    python launch/bench_moe.py                       # CPU fp32, the three reference shapes, T=4096
    python launch/bench_moe.py --device cuda --dtype bfloat16   # adds MegaBlocks' kernels where installed

Every row times forward+backward of each implementation on identical inputs in the same process, interleaved
round by round so that machine noise hits all of them alike, and reports medians and ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from moe_lm.cli import run
from moe_lm.config import ModelConfig, MoEConfig
from moe_lm.interop.hf import to_hf_config
from moe_lm.model import MoE
from moe_lm.model.layers import MLP
from moe_lm.ops.cpu_kernels import load_cpu_kernels
from moe_lm.ops.megablocks import BackendUnavailable, load_megablocks

# (dim, moe_inter_dim, n_routed_experts, num_experts_per_tok, n_group, topk_group)
SHAPES = {
    "cpu": [(256, 256, 8, 2, 1, 1), (512, 256, 16, 2, 1, 1), (256, 128, 64, 8, 8, 4)],
    # configs/gpu_1b.yaml's layer, Moonlight-16B-A3B's (DeepSeek-V3-16B shape), and a Mixtral-like one
    "gpu": [(1024, 384, 64, 6, 8, 4), (2048, 1408, 64, 6, 1, 1), (4096, 14336, 8, 2, 1, 1)],
}


def hf_moe(cfg: ModelConfig, ours: MoE, impl: str, dtype: torch.dtype, device: str):
    """HF DeepseekV3MoE with our weights copied in (key names are identical)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hf_cfg = to_hf_config(cfg)
    hf_cfg._experts_implementation = impl
    hf = DeepseekV3MoE(hf_cfg)
    hf.load_state_dict(ours.state_dict(), strict=True)
    return hf.to(device=device, dtype=dtype)


def time_fwd_bwd(fns: dict, x: torch.Tensor, grad: torch.Tensor, reps: int, warmup: int) -> dict[str, float]:
    """Median fwd+bwd milliseconds of each callable, interleaved round-robin."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    for r in range(warmup + reps):
        for name, fn in fns.items():
            xi = x.detach().requires_grad_(True)
            sync()
            t0 = time.perf_counter()
            out = fn(xi)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(grad)
            sync()
            if r >= warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _megablocks_available() -> bool:
    try:
        load_megablocks()
        return True
    except BackendUnavailable as e:
        print(f"# megablocks not timed: {e}")
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", choices=list(SHAPES), default=None, help="default: cpu on CPU, gpu on CUDA")
    ap.add_argument("--tokens", type=int, default=None, help="default: 4096 on CPU, 16384 on CUDA")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens are shaped [tokens/seq_len, seq_len]")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--no-hf", action="store_true", help="skip HF's DeepseekV3MoE (transformers not installed)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    on_gpu = args.device.startswith("cuda")
    shapes = SHAPES[args.shapes or ("gpu" if on_gpu else "cpu")]
    args.tokens = args.tokens or (16384 if on_gpu else 4096)
    torch.manual_seed(0)
    print(
        f"# torch {torch.__version__}, device {args.device}, {args.dtype}, threads {torch.get_num_threads()}, "
        f"T={args.tokens}, fwd+bwd median of {args.reps} (ms)"
    )
    if args.device == "cpu":
        kernels = load_cpu_kernels()
        print(f"# CPU kernels: {kernels.__name__ if kernels else 'unavailable, PyTorch fallback'}")
    megablocks = args.device.startswith("cuda") and _megablocks_available()
    header = (
        "| d | I | E | k | groups | ours | dense-equiv | ours/dense | loop | HF eager | HF grouped_mm | ours/best HF |"
        + (" megablocks | megablocks/ours |" if megablocks else "")
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for dim, inter, E, k, n_group, topk_group in shapes:
        moe_cfg = MoEConfig(
            n_routed_experts=E,
            num_experts_per_tok=k,
            n_group=n_group,
            topk_group=topk_group,
            moe_inter_dim=inter,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
        )
        cfg = ModelConfig(dim=dim, moe=moe_cfg)
        ours = MoE(cfg).to(device=args.device, dtype=dtype).train()
        loop = MoE(replace(cfg, moe=replace(moe_cfg, experts_impl="loop"))).to(device=args.device, dtype=dtype).train()
        loop.load_state_dict(ours.state_dict())
        dense = MLP(dim, (moe_cfg.n_shared_experts + k) * inter).to(device=args.device, dtype=dtype)
        fns = {"ours": ours, "dense": dense, "loop": loop}
        if megablocks:
            fns["megablocks"] = MoE(replace(cfg, moe=replace(moe_cfg, experts_impl="megablocks")))
            fns["megablocks"].load_state_dict(ours.state_dict())
            fns["megablocks"].to(device=args.device, dtype=dtype).train()
        if not args.no_hf:
            fns["hf_eager"] = hf_moe(cfg, ours, "eager", dtype, args.device)
            fns["hf_grouped"] = hf_moe(cfg, ours, "grouped_mm", dtype, args.device)
        x = torch.randn(args.tokens // args.seq_len, args.seq_len, dim, device=args.device, dtype=dtype)
        grad = torch.randn_like(x)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        t = time_fwd_bwd(fns, x, grad, args.reps, args.warmup)
        best_hf = min(t.get("hf_eager", float("nan")), t.get("hf_grouped", float("nan")))
        groups = f"{n_group}/{topk_group}" if n_group > 1 else "-"
        print(
            f"| {dim} | {inter} | {E} | {k} | {groups} | {t['ours']:.1f} | {t['dense']:.1f} | "
            f"{t['ours'] / t['dense']:.2f} | {t['loop']:.1f} | {t.get('hf_eager', float('nan')):.1f} | "
            f"{t.get('hf_grouped', float('nan')):.1f} | {t['ours'] / best_hf:.2f} |"
            + (f" {t['megablocks']:.1f} | {t['megablocks'] / t['ours']:.2f} |" if megablocks else ""),
            flush=True,
        )
        # fwd + bwd = 3 x the forward's 2 FLOPs per multiply-add, over the active expert width (1 shared + k)
        tflops = 6 * args.tokens * dim * 3 * (1 + k) * inter / (t["ours"] / 1e3) / 1e12
        peak = f", peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB (all arms)" if on_gpu else ""
        print(f"#   ours: {tflops:.1f} TFLOP/s of expert matmuls{peak}", flush=True)


if __name__ == "__main__":
    run(main)
