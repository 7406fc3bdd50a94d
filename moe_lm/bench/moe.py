"""Benchmark the MoE layer against a dense SwiGLU of equal active FLOPs and HF's DeepseekV3MoE, side by side.

    python -m moe_lm.bench moe                        # CPU fp32, the three reference shapes, T=4096
    python -m moe_lm.bench moe --device cuda --dtype bfloat16   # adds MegaBlocks' kernels where installed

Every row times forward+backward of each implementation on identical inputs in the same process, interleaved
round by round so that machine noise hits all of them alike, and reports medians and ratios.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from moe_lm.bench.timing import markdown_row, markdown_table, no_sync, time_interleaved
from moe_lm.config import ModelConfig, MoEConfig
from moe_lm.errors import UserError
from moe_lm.flags import from_flags, torch_device
from moe_lm.interop.hf import to_hf_config
from moe_lm.model import MoE
from moe_lm.model.layers import MLP
from moe_lm.ops.cpu_kernels import load_cpu_kernels
from moe_lm.ops.megablocks import BackendUnavailable, load_megablocks

# (dim, moe_inter_dim, n_routed_experts, num_experts_per_tok, n_group, topk_group)
Shape = tuple[int, int, int, int, int, int]
SHAPES: dict[str, list[Shape]] = {
    "cpu": [(256, 256, 8, 2, 1, 1), (512, 256, 16, 2, 1, 1), (256, 128, 64, 8, 8, 4)],
    # configs/gpu_1b.yaml's layer, Moonlight-16B-A3B's (DeepSeek-V3-16B shape), and a Mixtral-like one
    "gpu": [(1024, 384, 64, 6, 8, 4), (2048, 1408, 64, 6, 1, 1), (4096, 14336, 8, 2, 1, 1)],
}
NAN = float("nan")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--shapes", choices=list(SHAPES), default=None, help="layer shapes (none given: cpu on CPU, gpu on CUDA)"
    )
    ap.add_argument(
        "--tokens", type=int, default=None, help="tokens per forward (none given: 4096 on CPU, 16384 on CUDA)"
    )
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens are shaped [tokens/seq_len, seq_len]")
    ap.add_argument("--reps", type=int, default=10, help="timed rounds per shape (the median is reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds before them")
    ap.add_argument(
        "--device",
        default="cpu",
        type=torch_device,
        help="torch device (cuda: the GPU shapes, MegaBlocks where installed)",
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and activations")
    ap.add_argument("--no-hf", action="store_true", help="skip HF's DeepseekV3MoE (transformers not installed)")


def hf_moe(cfg: ModelConfig, ours: MoE, impl: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """HF DeepseekV3MoE with our weights copied in (key names are identical)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hf_cfg = to_hf_config(cfg)
    hf_cfg._experts_implementation = impl
    with torch.device(device):
        hf = DeepseekV3MoE(hf_cfg)
    hf.load_state_dict(ours.state_dict(), strict=True)
    return hf.to(dtype=dtype)


@dataclass(frozen=True)
class MoEBench:
    """What the layer benchmark's helpers read: where, in what type, on how many tokens, how many rounds."""

    device: str
    dtype: str
    tokens: int
    seq_len: int
    reps: int
    warmup: int
    no_hf: bool


def implementations(shape: Shape, bench: MoEBench, megablocks: bool) -> dict[str, torch.nn.Module]:
    """Every implementation timed at `shape`, with the same weights: ours (its configured experts_impl), the loop
    over experts, a dense MLP as wide as the active experts (1 shared + k), MegaBlocks and HF where asked for."""
    dim, inter, E, k, n_group, topk_group = shape
    dtype = getattr(torch, bench.dtype)
    moe_cfg = MoEConfig(n_routed_experts=E, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
                        moe_inter_dim=inter, n_shared_experts=1, routed_scaling_factor=2.5)  # fmt: skip
    cfg = ModelConfig(dim=dim, moe=moe_cfg)

    def moe(impl: str | None = None) -> MoE:
        with torch.device(bench.device):  # why built there: the large shapes take a minute to initialise on a CPU
            layer = MoE(replace(cfg, moe=replace(moe_cfg, experts_impl=impl)) if impl else cfg)
        return layer.to(dtype=dtype).train()

    ours, loop = moe(), moe("loop")
    loop.load_state_dict(ours.state_dict())
    with torch.device(bench.device):
        dense = MLP(dim, (moe_cfg.n_shared_experts + k) * inter).to(dtype=dtype)
    fns: dict[str, torch.nn.Module] = {"ours": ours, "dense": dense, "loop": loop}
    if megablocks:
        fns["megablocks"] = moe("megablocks")
        fns["megablocks"].load_state_dict(ours.state_dict())
    if not bench.no_hf:
        fns["hf_eager"] = hf_moe(cfg, ours, "eager", dtype, bench.device)
        fns["hf_grouped"] = hf_moe(cfg, ours, "grouped_mm", dtype, bench.device)
    return fns


def fwd_bwd(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """One forward+backward of `layer` on a fresh leaf of `x` (HF's MoE returns a tuple: its first element)."""

    def step() -> None:
        out = layer(x.detach().requires_grad_(True))
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)

    return step


def time_shape(shape: Shape, bench: MoEBench, megablocks: bool) -> dict[str, float]:
    """Median forward+backward milliseconds of every implementation at `shape`, interleaved round-robin."""
    layers = implementations(shape, bench, megablocks)
    dtype = getattr(torch, bench.dtype)
    x = torch.randn(bench.tokens // bench.seq_len, bench.seq_len, shape[0], device=bench.device, dtype=dtype)
    grad = torch.randn_like(x)
    sync = torch.cuda.synchronize if x.is_cuda else no_sync
    if x.is_cuda:
        torch.cuda.reset_peak_memory_stats()  # the peak printed after the row: the timing's, models and inputs held
    fns = {name: fwd_bwd(layer, x, grad) for name, layer in layers.items()}
    stats = time_interleaved(fns, bench.reps, bench.warmup, sync=sync)
    return {name: 1e3 * s.median for name, s in stats.items()}


def columns(megablocks: bool) -> list[str]:
    cols = ["d", "I", "E", "k", "groups", "ours", "dense-equiv", "ours/dense", "loop", "HF eager", "HF grouped_mm",
            "ours/best HF"]  # fmt: skip
    return cols + (["megablocks", "megablocks/ours"] if megablocks else [])


def row(shape: Shape, t: dict[str, float], megablocks: bool) -> list[str]:
    """The table's cells for one shape's median milliseconds `t` (nan where HF was skipped)."""
    dim, inter, E, k, n_group, topk_group = shape
    hf_eager, hf_grouped = t.get("hf_eager", NAN), t.get("hf_grouped", NAN)
    best_hf = min(hf_eager, hf_grouped)
    groups = f"{n_group}/{topk_group}" if n_group > 1 else "-"
    cells = [str(dim), str(inter), str(E), str(k), groups, f"{t['ours']:.1f}", f"{t['dense']:.1f}",
             f"{t['ours'] / t['dense']:.2f}", f"{t['loop']:.1f}", f"{hf_eager:.1f}", f"{hf_grouped:.1f}",
             f"{t['ours'] / best_hf:.2f}"]  # fmt: skip
    return cells + ([f"{t['megablocks']:.1f}", f"{t['megablocks'] / t['ours']:.2f}"] if megablocks else [])


def _megablocks_available() -> bool:
    try:
        load_megablocks()
        return True
    except BackendUnavailable as e:
        print(f"# megablocks not timed: {e}")
        return False


def run(args: argparse.Namespace) -> None:
    on_gpu = args.device.startswith("cuda")
    shapes = SHAPES[args.shapes or ("gpu" if on_gpu else "cpu")]
    args.tokens = args.tokens or (16384 if on_gpu else 4096)
    if args.seq_len < 1 or args.tokens < args.seq_len or args.reps < 1 or args.warmup < 0:
        raise UserError("--seq-len and --reps must be >= 1, --tokens >= --seq-len, --warmup >= 0")
    request = from_flags(MoEBench, args)
    torch.manual_seed(0)
    print(
        f"# torch {torch.__version__}, device {args.device}, {args.dtype}, threads {torch.get_num_threads()}, "
        f"T={args.tokens}, fwd+bwd median of {args.reps} (ms)"
    )
    if args.device == "cpu":
        kernels = load_cpu_kernels()
        print(f"# CPU kernels: {kernels.__name__ if kernels else 'unavailable, PyTorch fallback'}")
    megablocks = on_gpu and _megablocks_available()
    print(markdown_table(columns(megablocks)))
    for shape in shapes:
        t = time_shape(shape, request, megablocks)
        print(markdown_row(row(shape, t, megablocks)), flush=True)
        dim, inter, k = shape[0], shape[1], shape[3]
        # fwd + bwd = 3 x the forward's 2 FLOPs per multiply-add, over the active expert width (1 shared + k)
        tflops = 6 * args.tokens * dim * 3 * (1 + k) * inter / (t["ours"] / 1e3) / 1e12
        peak = f", peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB (all arms)" if on_gpu else ""
        print(f"#   ours: {tflops:.1f} TFLOP/s of expert matmuls{peak}", flush=True)
