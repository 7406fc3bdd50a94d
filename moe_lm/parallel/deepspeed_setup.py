"""DeepSpeed: process-group start-up, the DeepSpeed JSON derived from our config, and engine construction; and,
when a rank dies, which one it was.

Batch sizes, precision, clipping and the ZeRO stage have one home (our config); the DeepSpeed dict is derived.
"""

from __future__ import annotations

import importlib
import os
import re
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.comm.torch import build_shm_op
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

from moe_lm.config import OptimConfig, ParallelConfig, TrainConfig
from moe_lm.console import library_prints, quiet_deepspeed
from moe_lm.ops.extension_builds import library_op_builds
from moe_lm.parallel.engine import Engine
from moe_lm.parallel.ports import free_port


def init_distributed() -> None:
    """Join the process group the `deepspeed` launcher set up; a plain `python` run becomes a world of one."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    quiet_deepspeed()  # again: importing deepspeed reset its logger's level
    cpu = get_accelerator().device_name() == "cpu"
    with library_prints():  # why: DeepSpeed's CPU op prints a line on every start
        if cpu and int(os.environ["WORLD_SIZE"]) == 1:
            # why without it: one process reduces nothing, but DeepSpeed would build its shared-memory op (a minute
            # of g++ in a new installation) and map its buffers; it uses the op only where it finds one
            # (the module by its full name: the attribute `deepspeed.comm.torch` is torch itself)
            with mock.patch.object(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None):
                deepspeed.init_distributed(verbose=False)
            return
        if cpu:
            # why first and apart: on CPU DeepSpeed builds (or loads) its shared-memory communication op with torch's
            # loader at the start of init_distributed; loaded here, in our folder under our flock, DeepSpeed's call
            # finds it loaded. The flock must not span init_distributed: that waits for the other ranks of this host,
            # which would be waiting for the flock.
            build_cpu_comm_op()
        deepspeed.init_distributed(verbose=False)
        if cpu:
            # why: each rank's op creates its /dev/shm buffer, then spins in C (holding the GIL, so deaf to SIGTERM)
            # until it has mapped every other rank's. A rank that got through first and failed at once (a config
            # or data error) removed the buffers on its way out while a slower rank still looked for them: that
            # rank spun until the launcher's SIGKILL 30 s later, forever under a launcher that sends none. After
            # this barrier every buffer is mapped and removing them is safe.
            dist.barrier()


def build_cpu_comm_op() -> None:
    """Build (or load) DeepSpeed's shared-memory communication op for CPU ranks in moe-lm's build folder, one build at
    a time (moe_lm/ops/extension_builds.py); `make setup` builds it ahead of the first run of several processes."""
    with library_op_builds(Path(deepspeed.__file__).parent, "deepspeed_shm_comm"):
        build_shm_op()


def shutdown_distributed() -> None:
    """Leave the process group cleanly at the end of a process.

    why: a rank that exits while gloo's threads still run can abort ("terminate called without an active
    exception"), failing a run that had finished its work.
    """
    if dist.is_initialized():
        dist.barrier()
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            remove_shm_buffers(os.environ.get("MASTER_PORT", ""))
        # why DeepSpeed's: it also drops its cached groups (expert-parallel, data-parallel), which would otherwise
        # name destroyed groups when this process trains again (a notebook, a sweep in one process)
        deepspeed.comm.destroy_process_group()


# ---- a dead peer -------------------------------------------------------------------------------------------------
# How a rank learns that another one died: on CPU (gloo) the collective it waits in raises a RuntimeError within
# milliseconds of a kill -9 ("[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:24747",
# or "Connection reset by peer"), and after the process group's timeout when the peer's node vanished without
# closing its sockets ("Timed out waiting ...ms"). The error names an address and port, not a rank, so each rank
# publishes its host and pid once at start (`peers`), and a survivor then asks the operating system which of
# them are gone (`dead_ranks`). why not a heartbeat: it costs a thread and store traffic for the whole run, to
# know something the kernel already knows for ranks on this host; for another host the error's address names it.

_PEER_GONE = ("/gloo/transport/", "Connection closed by peer", "Connection reset by peer", "Broken pipe")
_LEFT = "moe_lm/left/{rank}"  # store key: this rank saw a peer die and is leaving on purpose


class Peer(NamedTuple):
    rank: int
    host: str
    pid: int
    addrs: tuple[str, ...]  # what the host name resolves to: the address gloo binds to by default


def peers() -> list[Peer]:
    """Every rank's host, pid and addresses, in rank order (one all-gather at start; a collective)."""
    host = socket.gethostname()
    try:
        addrs = tuple(socket.gethostbyname_ex(host)[2])
    except OSError:
        addrs = ()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (host, os.getpid(), addrs))
    return [Peer(r, *p) for r, p in enumerate(gathered)]


def is_peer_failure(exc: BaseException) -> bool:
    """Whether an exception out of a collective means another rank (or its node, or the network) is gone."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and any(s in str(exc) for s in _PEER_GONE))


def peer_failure_reason(exc: BaseException) -> str:
    """The backend's own words, short: 'Connection closed by peer [10.0.0.2]:41234'."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", str(exc).strip())  # gloo's source location prefix
    return text.split(". ")[0].split("\n")[0]


def leaving_on_purpose() -> None:
    """Tell the others (through the store rank 0 hosts) that this rank exits because a peer died: the rank that
    reports must not count it among the dead once it is gone. Best effort: with rank 0 dead there is no store."""
    try:
        _store().set(_LEFT.format(rank=dist.get_rank()), "1")
    except (RuntimeError, ValueError, AttributeError):
        pass


def dead_ranks(everyone: list[Peer], wait_s: float = 3.0) -> list[int]:
    """The ranks on this host whose process is gone (exited, killed, or a zombie), leaving out those that left on
    purpose. Waits up to `wait_s` for one to appear: a killed process closes its sockets before the kernel marks
    it dead, so the first look can come too early. Ranks on other hosts are not visible here: see `suspect_host`."""
    import psutil  # a DeepSpeed dependency

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    me = dist.get_rank()
    here = [p for p in everyone if p.host == everyone[me].host and p.rank != me]
    deadline = time.monotonic() + wait_s
    while True:
        dead = [p.rank for p in here if gone(p.pid) and not _left_on_purpose(p.rank)]
        if dead or not here or time.monotonic() > deadline:
            return dead
        time.sleep(0.1)


def _left_on_purpose(rank: int) -> bool:
    try:
        return _store().check([_LEFT.format(rank=rank)])
    except (RuntimeError, ValueError, AttributeError):
        return False


def _store():
    """The process group's key-value store (served by rank 0), with a short timeout: its host may be gone too."""
    store = dist.distributed_c10d._get_default_store()  # why private: the only handle on the launcher's store
    store.set_timeout(timedelta(seconds=2))
    return store


def suspect_host(everyone: list[Peer], exc: BaseException) -> str | None:
    """The other host whose address the backend's error names (gloo: '... by peer [10.0.0.2]:41234'), or None."""
    me = everyone[dist.get_rank()]
    for addr in re.findall(r"\[([0-9a-fA-F.:]+)\]:\d+", str(exc)):
        hosts = {p.host for p in everyone if addr in p.addrs and p.host != me.host}
        if len(hosts) == 1:
            return hosts.pop()
    return None


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


def use_bf16(p: ParallelConfig, dev: torch.device) -> bool:
    # why fp32 on CPU: bf16 matmuls are not faster there (docs/deepspeed.md §5) and fp32 keeps CPU runs exact.
    return p.dtype == "bf16" or (p.dtype == "auto" and dev.type == "cuda")


def zero_optimization(p: ParallelConfig, world: int) -> dict:
    """ZeRO's settings at `world` ranks: parallel.zero_stage with what it needs for MoE (docs/deepspeed.md §3:
    contiguous gradients and reduce-scatter; overlap_comm as our multi-rank tests run), but on a single rank ZeRO-1
    without the contiguous gradient buffer.

    why on one rank: there ZeRO's reductions reduce and partition nothing, yet ZeRO-2 runs them after every
    micro-batch in backward hooks (each gradient copied into the contiguous bucket, the bucket divided by the world
    size, flattened and copied back, then copied into the flat partition: five passes over the gradients and
    per-parameter work), ZeRO-1 once a step, and without the contiguous buffer in three passes. The engine is
    otherwise the same: the same fp32 master partition, norm, clipping and non-finite check, the same weights bit
    for bit (fp32 and bf16, with accumulation; checked), and the same checkpoint files (DeepSpeed does not check the
    stage on load), so a run resumes across the switch."""
    one_rank = world == 1
    return {
        "stage": 1 if one_rank else p.zero_stage,
        "contiguous_gradients": not one_rank,
        "reduce_scatter": True,
        "overlap_comm": False,
    }


def deepspeed_config(t: TrainConfig, o: OptimConfig, p: ParallelConfig, bf16: bool, *, world: int) -> dict:
    """The engine's config from the sections it reads: batch shape (train), clipping (optim), ZeRO (parallel), at
    `world` ranks."""
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "gradient_clipping": o.grad_clip,
        "zero_optimization": zero_optimization(p, world),
        # check_grad_overflow: a non-finite gradient skips the step in bf16 too (fp32 always checks the norm).
        "bf16": {"enabled": bf16, "check_grad_overflow": True},
        # our own torch AdamW (one home for the optimizer, no JIT-built DeepSpeed op needed)
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


def build_engine(model: torch.nn.Module, *, optim: OptimConfig, train: TrainConfig, parallel: ParallelConfig) -> Engine:
    """Wrap the plain model in a DeepSpeed engine with AdamW and the config derived from the three sections."""
    o, t, p = optim, train, parallel
    dev = device()
    bf16 = use_bf16(p, dev)
    model = model.to(dev)
    groups = param_groups(model, o.weight_decay)
    if any(is_moe_param(p) for p in model.parameters()):
        # expert parameters get their own groups so ZeRO reduces them over the expert-data-parallel group only
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    # fused (torch has it for CUDA and the CPU): one pass over each flat partition for the whole update, where the
    # per-operation AdamW makes about ten (docs/benchmarks.md, "loop"); the same update, rounded otherwise
    fused = dev.type in ("cuda", "cpu")
    optimizer = torch.optim.AdamW(
        groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, fused=fused
    )
    config = deepspeed_config(t, o, p, bf16, world=dist.get_world_size())
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine
