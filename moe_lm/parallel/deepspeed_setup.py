"""DeepSpeed: process-group start-up, the DeepSpeed JSON derived from our config, and engine construction.

Batch sizes, precision, clipping and the ZeRO stage have one home (our config); the DeepSpeed dict is derived.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

from moe_lm.config import Config


def init_distributed() -> None:
    """Join the process group the `deepspeed` launcher set up; a plain `python` run becomes a world of one."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed(verbose=False)


def shutdown_distributed() -> None:
    """Leave the process group cleanly at the end of a process.

    why: a rank that exits while gloo's threads still run can abort ("terminate called without an active
    exception"), failing a run that had finished its work.
    """
    if dist.is_initialized():
        dist.barrier()
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            remove_shm_buffers(os.environ.get("MASTER_PORT", ""))
        dist.destroy_process_group()


def remove_shm_buffers(master_port: str) -> None:
    """Delete the /dev/shm files of DeepSpeed's CPU shared-memory all-reduce for the job on this port.

    why: DeepSpeed creates one 66 MB file per rank and never removes it (deepspeedai/DeepSpeed#4115); they pile
    up run after run until /dev/shm is full and later runs abort. Unlinking a mapped file is safe: the memory
    lives until the last process unmaps it.
    """
    for f in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{master_port}_*"):
        f.unlink(missing_ok=True)


def device() -> torch.device:
    acc = get_accelerator()
    if acc.device_name() == "cpu":
        return torch.device("cpu")
    return torch.device(acc.device_name(), int(os.environ.get("LOCAL_RANK", 0)))


def use_bf16(cfg: Config, dev: torch.device) -> bool:
    # why fp32 on CPU: bf16 matmuls are not faster there (docs/deepspeed.md §5) and fp32 keeps CPU runs exact.
    return cfg.parallel.dtype == "bf16" or (cfg.parallel.dtype == "auto" and dev.type == "cuda")


def deepspeed_config(cfg: Config, bf16: bool) -> dict:
    t, p = cfg.train, cfg.parallel
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {
            "stage": p.zero_stage,
            # docs/deepspeed.md §3: the settings under which ZeRO-2 reduces MoE gradients correctly.
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "overlap_comm": False,
        },
        # check_grad_overflow: a non-finite gradient skips the step in bf16 too (fp32 always checks the norm).
        "bf16": {"enabled": bf16, "check_grad_overflow": True},
        # our own torch AdamW (one home for the optimizer, no JIT-built fused op needed on CPU)
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; never decay norms' gains (1-D). The router bias is a buffer and never reaches here."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def build_engine(model: torch.nn.Module, cfg: Config):
    """Wrap the plain model in a DeepSpeed engine with AdamW and the derived config."""
    dev = device()
    bf16 = use_bf16(cfg, dev)
    model = model.to(dev)
    o = cfg.optim
    groups = param_groups(model, o.weight_decay)
    if any(is_moe_param(p) for p in model.parameters()):
        # expert parameters get their own groups so ZeRO reduces them over the expert-data-parallel group only
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    # fused: one kernel for the whole update on CUDA (the optimizer step moves every parameter's states)
    optimizer = torch.optim.AdamW(
        groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, fused=dev.type == "cuda"
    )
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg, bf16))
    return engine
