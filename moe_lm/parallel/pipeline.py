"""Pipeline parallelism: the Transformer as DeepSpeed pipeline layers, cut into `parallel.pp_size` stages.

    layer 0          the token embedding (tied: the last stage holds it too when the model has MTP modules)
    layers 1..n      the decoder blocks, one layer each; each rebuilds its rotary table (and mask) from the
                     activation's shape, so only the hidden states [B, S, D] travel between stages
    layer n + 1      the final norm, then on the same stage the output head and the MTP modules (in the loss)
    (layer n + 2)    the embedding again, as a pass-through, so that the MTP modules on the last stage can read it
(numbered and cut in moe_lm/deepspeed_layout.py). The loss the last stage ends in is the training objective's, given
to `build_pipeline` (moe_lm/train/step.py: the next-token loss with the MTP modules).

DeepSpeed's engine (runtime/pipe/engine.py) cuts the list by parameter count (the embedding and head counted),
runs the 1F1B schedule through `engine.train_batch` / `eval_batch`, and all-reduces the tied embedding's gradient
between the first and last stage. The first stage reads the micro-batch's inputs, the last its labels: the MTP
modules read their future tokens from the labels (token t_{i+k} is label i + k - 1).

The balance losses (sequence-wise, global) are carried across stages the way Megatron-Core's
`MoEAuxLossAutoScaler` does: each block attaches its loss to its output with an autograd function whose backward
injects the loss's own gradient, 1 / gradient-accumulation steps (the weight DeepSpeed's backward gives the main
loss). why not as a second tensor passed along: that costs a send and a receive per micro-batch and stage for a
number whose gradient is a known constant, and DeepSpeed's pipeline buffers would carry a 0-d tensor beside the
activations; the injection is exact and local.

Every rank builds the whole Transformer first (from the seed, as a single process does), so a stage's weights are
the single process's; the stages keep references to their own layers. The model's routers that a stage does not
run never count a token, so the bias update (train/balance.py), which sums every router's counts over the world,
gives each layer its counts over its stage's data-parallel ranks, and every rank keeps every layer's bias exact.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
from torch import nn

from moe_lm.config import Config
from moe_lm.console import library_prints
from moe_lm.deepspeed_layout import stage_slices
from moe_lm.model import ModelOutput, Transformer
from moe_lm.model.attention import rope_cos_sin
from moe_lm.model.masks import mask_provider

EMBED = "embed"  # the tied layers' key


class AuxLossAutoScaler(torch.autograd.Function):
    """forward: the activation, unchanged; backward: its gradient, and `scale` for the balance loss `aux`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


@dataclass
class StepTally:
    """What the stages add up over a step's micro-batches in `values`: [ce, aux, mtp_1..mtp_D, micro-batches], the
    order train_step logs; the balance losses on every stage, the rest on the stage that computes the loss."""

    depth: int
    aux_scale: float = 1.0  # the balance loss's gradient weight: 1 / gradient-accumulation steps
    mtp_weight: float = 0.0  # this step's lambda
    values: torch.Tensor = field(default=None)  # type: ignore[assignment]
    last: ModelOutput | None = None  # evaluation: the last micro-batch's output (last stage)

    def reset(self, device) -> None:
        self.values = torch.zeros(3 + self.depth, device=device)

    def add_aux(self, aux: torch.Tensor) -> None:
        if self.values is not None and torch.is_grad_enabled():
            self.values[1] += aux.detach().float()


class Embedding(nn.Module):
    """Layer 0 (and the last stage's tied copy): token ids [B, S] -> x [B, S, D]."""

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens_BS)


def _pass_through(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x


class BlockLayer(nn.Module):
    """One decoder block as a pipeline layer: x [B, S, D] -> x [B, S, D], its balance loss attached."""

    def __init__(self, model: Transformer, index: int, tally: StepTally) -> None:
        super().__init__()
        self.block = model.layers[index]
        self.index, self.n_layers = index, len(model.layers)
        self.heads, self.provider = model.cfg.n_heads, mask_provider(model.cfg.attn_mask)
        # a plain attribute, not a buffer: the rotary frequencies stay fp32 when the engine casts the stage to bf16
        self.inv_freq, self.rope_factor = model.inv_freq.detach().clone(), model.rope_factor
        self.tally = tally

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        S = x_BSD.shape[1]
        positions = torch.arange(S, device=x_BSD.device)
        cos, sin = rope_cos_sin(self.inv_freq.to(x_BSD.device), positions, x_BSD.dtype, self.rope_factor)
        mask = self.provider.layer_masks(S, None, x_BSD.device, self.heads, self.n_layers)[self.index]
        x_BSD, aux = self.block(x_BSD, cos, sin, mask)
        self.tally.add_aux(aux)
        if not aux.requires_grad:  # evaluation, or no balance loss configured
            return x_BSD
        return AuxLossAutoScaler.apply(x_BSD, aux, self.tally.aux_scale)


class Head(nn.Module):
    """The final norm, and (used by the loss on the same stage) the output head and the MTP modules."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.norm, self.lm_head, self.mtp = model.norm, model.lm_head, model.mtp

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.norm(x_BSD)  # h^0: what the output head and the first MTP module read


@dataclass
class Pipeline:
    """A model cut into stages: the PipelineModule DeepSpeed wraps, the tally its layers fill, and the full model
    (for the routers, the MTP count and the output head's weight)."""

    module: PipelineModule
    tally: StepTally
    model: Transformer
    # micro-batches per eval_batch call: DualPipeV's engine refuses fewer than 2 x pp_size
    eval_micro_batches: int = 1
    shapes_changed: bool = False  # an evaluation sent other shapes than training's since the last step

    @property
    def grid(self):
        return self.module._grid  # why private: DeepSpeed exposes the grid only through the module and engine


def build_pipeline(model: Transformer, pp_size: int, tally: StepTally, loss_fn, schedule: str = "1f1b") -> Pipeline:
    """The model as pipeline layers in `pp_size` stages, partitioned by parameters (a collective: every rank), its
    last stage ending in `loss_fn(h^0 [B, S, D], labels [B, S])` (the training objective's: moe_lm/train/step.py);
    `tally` is what the layers and the loss add up. schedule "dualpipev": 2 x pp_size slices, rank r holding slices
    r and 2 pp_size - 1 - r (DeepSpeed's DualPipeVModule; its engine is chosen by deepspeed.initialize from the
    module's type)."""
    embed = TiedLayerSpec(EMBED, Embedding, model.embed_tokens, tied_weight_attr=["embed_tokens.weight"])
    head = Head(model)
    layers = [embed, *(BlockLayer(model, i, tally) for i in range(len(model.layers))), head]
    if len(model.mtp):
        layers.append(
            TiedLayerSpec(
                EMBED, Embedding, model.embed_tokens, forward_fn=_pass_through, tied_weight_attr=["embed_tokens.weight"]
            )
        )
    dualpipev = schedule == "dualpipev"
    # why: over gloo DeepSpeed sends a stage's output with an in-place broadcast of the tensor autograd holds (p2p.py),
    # so every backward warns that broadcast_ has no autograd kernel. The source's broadcast leaves the tensor as it
    # was and its gradient comes back by an explicit send, so nothing is lost (the stages' gradients equal one
    # process's, tested); the warning would repeat on the console at every step.
    warnings.filterwarnings("ignore", message=r"c10d::broadcast_: an autograd kernel was not registered")
    with library_prints():  # why: it prints the seed, topology and partition on every start
        module = (DualPipeVModule if dualpipev else PipelineModule)(
            layers,
            num_stages=pp_size,
            loss_fn=loss_fn,
            partition_method="parameters",
            # evaluation's last micro-batch can be shorter than training's: 1F1B sends the shape every time;
            # DualPipeV refuses that and has its shapes reset instead (`PipelineObjective`, `pipeline_step`)
            dynamic_shape=not dualpipev,
        )
    return Pipeline(module, tally, model, 2 * pp_size if dualpipev else 1)


def check_cut(pipeline: Pipeline, cfg: Config) -> None:
    """The stage was built for the planner's cut (stage_parts); DeepSpeed's must be the same, or this rank would hold
    layers it never built (on the meta device). Tested equal; this guards a DeepSpeed whose cut differs."""
    planned, _ = stage_slices(cfg, dist.get_rank(), dist.get_world_size())
    if list(pipeline.module.parts) != planned:
        raise RuntimeError(
            f"DeepSpeed cut the pipeline's layers at {list(pipeline.module.parts)}, moe-lm built this stage for "
            f"{planned} (moe_lm/planning/stages.py follows DeepSpeed 0.19's partition_balanced): report it"
        )
