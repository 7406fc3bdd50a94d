"""One training step under torch.profiler: the kernels that take the most time, and where the step's time goes —
routing, dispatch, the expert GEMMs, the shared experts, attention, the loss, the optimizer — so that speed work can
be planned from the printed tables alone.

    python -m moe_lm.bench profile --config gpu_1b --device cuda --dtype bfloat16   # CUDA kernels, device time
    python -m moe_lm.bench profile                                                   # the tiny preset, CPU ops

The step is the training-step benchmark's (`Arm`: the objective `moe-lm train` steps, without DeepSpeed). How each
operation finds its part: the forward runs inside labelled ranges (forward hooks on each MoE layer's router and
experts, its shared experts, each attention; the loss and the optimizer around their calls); an operation of the
backward pass takes the part of the forward operation it differentiates (autograd's sequence number links the two).
Within the experts, matrix products (mm, bmm, grouped_mm, the CPU kernels' segment GEMMs) are the expert GEMMs and
every other operation (sort, gather, scatter, index_add: moving rows to their experts and back) is dispatch.
Times are each operation's own (its kernels' device time on CUDA, its CPU time on the CPU), summed; what no part
claims (embeddings, norms, dense MLPs, residual adds, the head) is "other".
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from moe_lm.bench.arms import Arm
from moe_lm.bench.timing import markdown_table
from moe_lm.config import load_config, preset_path
from moe_lm.errors import UserError
from moe_lm.flags import from_flags, torch_device

PARTS = ("routing", "dispatch", "expert GEMMs", "shared experts", "attention", "loss", "optimizer", "other")
LABELS = ("routing", "experts", "shared experts", "attention", "loss", "optimizer")  # the ranges the step opens
GEMM = re.compile(r"mm|matmul|linear|gemm|segment_?mlp", re.IGNORECASE)
BACKWARD_NODE = "autograd::engine::evaluate_function: "
TOP = 20


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", default="tiny", help="the preset or YAML file whose step is profiled")
    ap.add_argument("--device", default="cpu", type=torch_device, help="torch device")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and activations")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the profiled one (allocator, autotuning)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")


@dataclass(frozen=True)
class ProfileBench:
    config: str
    device: str
    dtype: str
    warmup: int
    overrides: list


def profiled_step(bench: ProfileBench) -> tuple[torch.profiler.profile, Arm]:
    """`bench.warmup` training steps, then one under the profiler with the parts labelled."""
    cfg = load_config(preset_path(bench.config), bench.overrides)
    arm = Arm("ours", cfg, bench.device, getattr(torch, bench.dtype))
    t = cfg.train
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=gen)
    batch = batch.to(bench.device)
    for _ in range(bench.warmup):
        arm.step(batch)
    hooks = label_modules(arm.model)
    on_gpu = torch.device(bench.device).type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
    try:
        with profile(activities=activities) as prof:
            out = arm.forward(batch)
            with record_function("loss"):
                loss = arm.loss(out, batch)
            loss.backward()
            with record_function("optimizer"):
                arm.update()
            if on_gpu:
                torch.cuda.synchronize()
    finally:
        for h in hooks:
            h.remove()
    return prof, arm


def label_modules(model: torch.nn.Module) -> list:
    """Forward hooks that open a labelled range when a router, an experts module, a shared-experts MLP or an
    attention starts and close it when it returns."""
    from moe_lm.model import MoE
    from moe_lm.model.attention import GQA, MLA

    hooks = []

    def labelled(module: torch.nn.Module, label: str) -> None:
        opened = []
        hooks.append(module.register_forward_pre_hook(lambda m, a: opened.append(record_function(label).__enter__())))
        hooks.append(module.register_forward_hook(lambda m, a, out: opened.pop().__exit__(None, None, None)))

    for module in model.modules():
        if isinstance(module, MoE):
            labelled(module.gate, "routing")
            labelled(module.experts, "experts")
            if module.shared_experts is not None:
                labelled(module.shared_experts, "shared experts")
        elif isinstance(module, (MLA, GQA)):
            labelled(module, "attention")
    return hooks


def parts(events, on_gpu: bool) -> dict[str, float]:
    """Microseconds of the step in each of PARTS (`placed`: each operation's own time, in its part)."""
    total: dict[str, float] = defaultdict(float)
    for e, part in placed(events):
        total[part] += e.self_device_time_total if on_gpu else e.self_cpu_time_total
    return {part: total.get(part, 0.0) for part in PARTS}


def placed(events) -> list[tuple[object, str]]:
    """Each operation of the step with its part: by the range it ran in, or for a backward operation by the range
    of the forward operation it differentiates. The ranges themselves and the kernels (whose time is their
    launching operation's own) are left out."""
    label_of: dict[int, str] = {}  # forward sequence number -> the range its operation ran in
    found = []
    for e in events:
        if e.name in LABELS or e.device_type != DeviceType.CPU:
            continue
        label, node = _enclosing(e)
        if label and e.sequence_nr >= 0:
            label_of.setdefault(e.sequence_nr, label)
        found.append((e, label, node))
    return [(e, _part(label if label or node is None else label_of.get(node.sequence_nr), e.name))
            for e, label, node in found]  # fmt: skip


def _enclosing(e) -> tuple[str | None, object]:
    """The labelled range around `e` (None outside every range) and the backward node it runs under, if any."""
    node = None
    parent = e
    while parent is not None:
        if parent.name in LABELS:
            return parent.name, node
        if node is None and parent.name.startswith(BACKWARD_NODE):
            node = parent
        parent = parent.cpu_parent
    return None, node


def _part(label: str | None, op: str) -> str:
    if label == "experts":
        return "expert GEMMs" if GEMM.search(op) else "dispatch"
    return label or "other"


def top_kernels(prof, on_gpu: bool, n: int = TOP) -> tuple[list[tuple[str, float]], float]:
    """The `n` CUDA kernels (on the CPU: operations) with the most own time, in microseconds, and the total."""
    if on_gpu:
        rows = [(e.key, e.self_device_time_total) for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    else:
        rows = [(e.key, e.self_cpu_time_total) for e in prof.key_averages() if e.key not in LABELS]
    rows.sort(key=lambda r: -r[1])
    return rows[:n], sum(t for _, t in rows)


def report(prof, on_gpu: bool) -> str:
    """The two tables and the one line of shares that `launch/gpu_check.py` reads."""
    kernels, total = top_kernels(prof, on_gpu)
    what = "CUDA kernel" if on_gpu else "operation (CPU)"
    lines = [markdown_table([what, "ms", "share"], [[_short(k), f"{t / 1e3:.2f}", f"{100 * t / total:.1f} %"]
                                                    for k, t in kernels])]  # fmt: skip
    split = parts(prof.events(), on_gpu)
    whole = sum(split.values()) or 1.0
    rows = [[p, f"{t / 1e3:.2f}", f"{100 * t / whole:.1f} %"] for p, t in split.items()]
    lines.append(markdown_table(["part of the step", "ms", "share"], rows))
    lines.append("shares: " + ", ".join(f"{p} {100 * t / whole:.1f} %" for p, t in split.items()))
    return "\n\n".join(lines)


def _short(name: str, width: int = 100) -> str:
    name = name.replace("|", "/")
    return name if len(name) <= width else name[: width - 3] + "..."


def run(args: argparse.Namespace) -> None:
    if args.warmup < 0:
        raise UserError("--warmup must be >= 0")
    bench = from_flags(ProfileBench, args)
    prof, arm = profiled_step(bench)
    t = arm.cfg.train
    print(f"# one training step of {bench.config} ({t.micro_batch_size} x {t.seq_len} tokens) on {bench.device}, "
          f"{bench.dtype}, after {bench.warmup} warm-up steps; torch {torch.__version__}")  # fmt: skip
    print(report(prof, torch.device(bench.device).type == "cuda"))
