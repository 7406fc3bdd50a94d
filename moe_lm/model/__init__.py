"""Pure single-device PyTorch model code: no torch.distributed, no deepspeed (parallelism is applied from outside)."""

from moe_lm.model.architectures import (
    build_model,
    count_params,
    decode_flops_per_token,
    initial_model,
    loss_chunk,
    reads_prefix,
    train_flops_per_token,
    uses_layer_seeds,
)
from moe_lm.model.experts import Experts
from moe_lm.model.moe import MoE
from moe_lm.model.params import ParamCount
from moe_lm.model.router import Router, Routing, update_biases
from moe_lm.model.transformer import ModelOutput, Transformer, build_by_layer

__all__ = [
    "Experts",
    "MoE",
    "ModelOutput",
    "ParamCount",
    "Router",
    "Routing",
    "Transformer",
    "build_by_layer",
    "build_model",
    "count_params",
    "decode_flops_per_token",
    "initial_model",
    "loss_chunk",
    "reads_prefix",
    "train_flops_per_token",
    "update_biases",
    "uses_layer_seeds",
]
