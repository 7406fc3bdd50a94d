"""Pure single-device PyTorch model code: no torch.distributed, no deepspeed (parallelism is applied from outside)."""

from moe_lm.model.experts import Experts
from moe_lm.model.moe import MoE
from moe_lm.model.params import ParamCount, count_params
from moe_lm.model.router import Router, Routing, update_biases
from moe_lm.model.transformer import ModelOutput, Transformer

__all__ = [
    "Experts",
    "MoE",
    "ModelOutput",
    "ParamCount",
    "Router",
    "Routing",
    "Transformer",
    "count_params",
    "update_biases",
]
