"""Expert parallelism, applied to a built model from outside (the model code stays single-device).

`apply_expert_parallel(model, ep_size)` keeps each rank's slice of every MoE layer's routed experts, wraps it in
an `ExpertShell`, and swaps in the all-to-all dispatcher. Router, shared experts, attention and embeddings stay
replicated and data-parallel over the whole world.

Why a shell of DeepSpeed's `MoE` type (docs/deepspeed.md §1-§4): the engine turns on its MoE handling only for
`isinstance(module, deepspeed.moe.layer.MoE)`: expert gradients are then reduced over the expert-data-parallel
group only (and divided by the full data-parallel size, which is already the global-batch mean, so we add no
scaling), the clip norm counts them once, and `save_checkpoint` writes one file per *global* expert, which is
what lets a checkpoint saved at one `ep_size` load at another. The shell holds no DeepSpeed gate or dispatch:
our router decides, our dispatcher moves tokens. It is applied at every `ep_size`, including 1, so checkpoints
always have the same per-expert layout.

DeepSpeed finds expert tensors by the name `<moe>.deepspeed_moe.experts.deepspeed_experts.<local id>.<param>`;
our experts are stacked [E_local, ...], so state-dict hooks (moe_lm/checkpoint/format.py, which reads the
same files without DeepSpeed) present them per expert and stack them back on load.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from deepspeed.utils import groups
from torch import nn

from moe_lm.config import require_ep_divides
from moe_lm.deepspeed_layout import per_expert_keys, stacked_keys
from moe_lm.model import Experts, Transformer
from moe_lm.model.moe import local_dispatch
from moe_lm.parallel.dispatch import AllToAllDispatcher


class ExpertShell(DeepSpeedMoE):
    """This rank's routed experts of one MoE layer, typed as DeepSpeed's MoE. forward = the local experts."""

    def __init__(self, local_experts: Experts, num_experts: int, ep_size: int) -> None:
        nn.Module.__init__(self)  # not DeepSpeedMoE.__init__: no DeepSpeed gate or experts are built
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.deepspeed_moe = nn.Module()
        self.deepspeed_moe.experts = local_experts
        for p in local_experts.parameters():
            p.allreduce = False  # what deepspeed.moe.utils.is_moe_param reads
            p.group_name = self.expert_group_name
        self.register_state_dict_post_hook(per_expert_keys)
        self.register_load_state_dict_pre_hook(stacked_keys)

    @property
    def local(self) -> Experts:
        return self.deepspeed_moe.experts

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Called by the engine: make sure DeepSpeed's expert / expert-data-parallel groups exist."""
        ensure_groups(self.ep_size, use_data_before_expert_parallel_)

    def forward(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
        return self.local(x_TD, idx_TK, weight_TK)


def ensure_groups(ep_size: int, use_data_before_expert_parallel_: bool = False, pp_size: int | None = None):
    """DeepSpeed's expert-parallel group of this rank (created on first use, by the first caller: ours, which
    knows `pp_size`, before the engine's).

    With pipeline stages the groups are made inside each stage: DeepSpeed's pipeline grid puts stage s on the
    consecutive ranks [s * W / pp, (s + 1) * W / pp) (axes pipe, data), and `_create_expert_and_data_parallel`
    given `pp_size` cuts the expert-parallel and expert-data-parallel groups within those blocks, so an expert's
    gradient is reduced with the same layer's replicas only, and the all-to-all joins ranks that reach each MoE
    layer together."""
    name = f"ep_size_{ep_size}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(
            ep_size, pp_size=pp_size or 1, use_data_before_expert_parallel_=use_data_before_expert_parallel_
        )
    return groups._get_expert_parallel_group(name)


def apply_expert_parallel(model: Transformer, ep_size: int, pp_size: int = 1) -> Transformer:
    """Shard every MoE layer's routed experts over `ep_size` ranks of a stage (in place; all ranks built the same
    model)."""
    E = model.cfg.moe.n_routed_experts
    require_ep_divides(ep_size, E, dist.get_world_size(), pp_size)
    group = ensure_groups(ep_size, pp_size=pp_size)
    ep_rank = dist.get_rank(group=group)
    n_local = E // ep_size
    nodes = ep_nodes(group) if ep_size > 1 else [0]
    for moe in model.moe_layers():
        full: Experts = moe.experts
        local = full  # ep_size 1: every expert is local, nothing to copy (a 1 B preset's experts are GBs)
        if ep_size > 1 and full.gate_up_proj.is_meta:  # a layer of another pipeline stage: never built here
            with torch.device("meta"):
                local = Experts(n_local, full.gate_up_proj.shape[2], full.down_proj.shape[2], full.impl)
        elif ep_size > 1:
            local = Experts(n_local, full.gate_up_proj.shape[2], full.down_proj.shape[2], full.impl)
            with torch.no_grad():
                keep = slice(ep_rank * n_local, (ep_rank + 1) * n_local)
                local.gate_up_proj.copy_(full.gate_up_proj[keep])
                local.down_proj.copy_(full.down_proj[keep])
        dispatch = AllToAllDispatcher(group, ep_size, n_local, nodes) if ep_size > 1 else local_dispatch
        moe.parallelize(ExpertShell(local, E, ep_size), dispatch)
    return model


def node_index() -> int | str:
    """This process's node: the launcher's node rank (DeepSpeed's CROSS_RANK, torchrun's GROUP_RANK, SLURM's
    SLURM_NODEID), else the host name. why the launcher's first: two launchers on one machine (a 2-node job tried
    on one host) share a host name but are two nodes."""
    for var in ("CROSS_RANK", "GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return socket.gethostname()


def ep_nodes(group) -> list[int]:
    """The node of each rank of the expert-parallel `group`, numbered 0.. in order of first appearance."""
    found: list = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(found, node_index(), group=group)
    order = list(dict.fromkeys(found))
    return [order.index(n) for n in found]


def dispatchers(model: Transformer) -> list[AllToAllDispatcher]:
    return [moe.dispatch for moe in model.moe_layers() if isinstance(moe.dispatch, AllToAllDispatcher)]
