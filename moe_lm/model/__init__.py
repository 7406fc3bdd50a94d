"""Pure single-device PyTorch model code: no torch.distributed, no deepspeed (parallelism is applied from outside)."""

import torch

from moe_lm.model.experts import Experts
from moe_lm.model.moe import MoE
from moe_lm.model.params import ParamCount, count_params
from moe_lm.model.router import Router, Routing, update_biases
from moe_lm.model.transformer import ModelOutput, Transformer


def build_model(cfg):
    """The model a ModelConfig describes: the decoder-only Transformer, or (arch=encdec) the encoder-decoder."""
    if cfg.arch == "encdec":
        from moe_lm.model.encdec import EncoderDecoder

        return EncoderDecoder(cfg)
    return Transformer(cfg)


def initial_model(cfg, seed: int):
    """The weights a run with this seed starts from (training seeds the global generator, then builds): the N1
    baselines and untrained twins of the analytics and experiments."""
    torch.manual_seed(seed)
    return build_model(cfg)


__all__ = [
    "Experts",
    "MoE",
    "ModelOutput",
    "ParamCount",
    "Router",
    "Routing",
    "Transformer",
    "build_model",
    "initial_model",
    "count_params",
    "update_biases",
]
