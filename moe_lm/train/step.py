"""One optimizer step, plain or in pipeline stages, and what a staged model's last stage computes: the next-token
loss with the MTP modules (`NextTokenLoss`, the pipeline's loss_fn) and the evaluation's objective
(`PipelineObjective`). The loop (moe_lm/train/loop.py) calls `train_step` or `pipeline_step`; the losses they return
are the means over every micro-batch of every rank."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_lm.model import ModelOutput, Transformer
from moe_lm.model.attention import rope_cos_sin
from moe_lm.parallel.engine import Engine, StagedEngine
from moe_lm.parallel.expert_parallel import dispatchers
from moe_lm.parallel.pipeline import Pipeline, StepTally
from moe_lm.train.objective import NEXT_TOKEN, Objective, logged_losses, next_token_losses, total_loss


def train_step(
    engine: Engine,
    model: Transformer,
    micro_batches,
    lr: float,
    mtp_weight: float = 0.0,
    objective: Objective = NEXT_TOKEN,
) -> tuple[dict, bool]:
    """One optimizer step over this rank's micro-batches [micro, seq_len + 1]. Returns the losses averaged over all
    micro-batches and ranks ({"loss": the main head's CE, "aux_loss", "mtp_loss/depth_k" per MTP depth}) and
    whether the update was applied (DeepSpeed skips it when the gradient norm is not finite, which a NaN/inf loss
    makes it)."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    engine.train()
    for d in dispatchers(model):
        d.reset_stats()
    depth = len(model.mtp)
    sums = torch.zeros(3 + depth, device=next(model.parameters()).device)  # ce, aux, mtp depths, micro-batches
    for batch in micro_batches:
        out, labels = objective.run(engine, batch, mtp=depth > 0, logits=not objective.loss_chunk)
        ce, mtp = next_token_losses(out, labels, model.lm_head.weight, objective.loss_chunk)
        engine.backward(total_loss(ce, mtp, mtp_weight, out.aux_loss))
        engine.step()
        sums += logged_losses(ce, mtp, out.aux_loss)
    return _step_losses(engine, sums)


def pipeline_step(engine: StagedEngine, pipeline: Pipeline, micro_batches, lr: float, mtp_weight: float = 0.0):
    """train_step's result for a model in pipeline stages: DeepSpeed's train_batch runs its schedule (1F1B or
    DualPipeV) over the micro-batches (forward, backward, the tied embedding's and the data-parallel gradient
    reductions, the step); the stages' layers and loss add up the losses they computed (pipeline.tally)."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    for d in dispatchers(pipeline.model):
        d.reset_stats()
    tally = pipeline.tally
    tally.reset(next(pipeline.module.parameters()).device)
    tally.mtp_weight = mtp_weight
    if pipeline.shapes_changed:  # an evaluation ran since: training's shapes are sent again
        engine.reset_activation_shape()
        pipeline.shapes_changed = False
    engine.train_batch(iter([(w[:, :-1], w[:, 1:]) for w in micro_batches]))
    return _step_losses(engine, tally.values)


def _step_losses(engine: Engine, sums: torch.Tensor) -> tuple[dict, bool]:
    """[ce, aux, mtp depths, micro-batches] summed over this rank's micro-batches -> the means over all ranks'
    (on every rank), and whether the step was applied."""
    if dist.get_world_size() > 1:
        dist.all_reduce(sums)
    means = (sums[:-1] / sums[-1]).tolist()  # why every step: a non-finite loss skips the step (the caller counts)
    losses = {"loss": means[0], "aux_loss": means[1]}
    losses.update({f"mtp_loss/depth_{k}": v for k, v in enumerate(means[2:], start=1)})
    return losses, engine.was_step_applied() and math.isfinite(means[0])


class NextTokenLoss:
    """The pipeline's loss_fn on the last stage: (h^0 [B, S, D], labels [B, S]) -> CE_main + lambda/D sum_k CE_k +
    the MTP blocks' balance losses, as train/objective.py's total_loss; adds each part to the tally."""

    def __init__(self, model: Transformer, tally: StepTally, loss_chunk: int) -> None:
        self.model, self.tally, self.chunk = model, tally, loss_chunk
        self.__name__ = "next_token_loss"  # what DeepSpeed prints for the partition

    def __call__(self, hidden_BSD: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        model, lm_head = self.model, self.model.lm_head
        out = ModelOutput(None, hidden_BSD.new_zeros((), dtype=torch.float32), hidden_BSD)
        if len(model.mtp):
            S = hidden_BSD.shape[1]
            # token t_{i+k} of the window is label i + k - 1; mtp_states reads tokens[:, k : k + S - k] for k >= 1
            tokens_BS = torch.cat((labels_BS[:, :1], labels_BS[:, :-1]), dim=1)
            cos, sin = rope_cos_sin(
                model.inv_freq.to(hidden_BSD.device), torch.arange(S, device=hidden_BSD.device), hidden_BSD.dtype,
                model.rope_factor,
            )  # fmt: skip
            out.mtp_hidden, out.aux_loss = model.mtp_states(tokens_BS, hidden_BSD, cos, sin)
        full_logits = not self.chunk or not torch.is_grad_enabled()  # evaluation sums the NLL from logits
        if full_logits:
            out.logits = lm_head(hidden_BSD)
            out.mtp_logits = [lm_head(h) for h in out.mtp_hidden]
        ce, mtp = next_token_losses(out, labels_BS, lm_head.weight, self.chunk)
        if not torch.is_grad_enabled():
            self.tally.last = out
            return ce
        self.tally.values += logged_losses(ce, mtp, out.aux_loss)
        return total_loss(ce, mtp, self.tally.mtp_weight, out.aux_loss)


@dataclass(frozen=True)
class PipelineObjective:
    """The evaluation's objective (train/evaluate.py) for a model in stages: one window batch through
    `engine.eval_batch`; the output exists on the last stage only (None elsewhere)."""

    engine: StagedEngine
    pipeline: Pipeline
    loss_chunk: int = 0

    def run(self, engine, window_BS1: torch.Tensor, mtp: bool = False, logits: bool = True):
        """One batch of windows through the stages. DualPipeV runs it 2 x pp_size times (its engine's least): the
        same windows, so the last output and routing are theirs."""
        labels, p = window_BS1[:, 1:], self.pipeline
        p.tally.last = None
        self.engine.reset_activation_shape()  # why: windows of another batch size than the last call's
        p.shapes_changed = True
        batches = [(window_BS1[:, :-1], labels)] * p.eval_micro_batches
        self.engine.eval_batch(iter(batches), num_micro_batches=len(batches), bcast_loss=False)
        return p.tally.last, labels
