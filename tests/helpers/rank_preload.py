"""Imported once by the server process that forks the ranks of tests/helpers/ranks.py: what every rank needs
(torch, DeepSpeed with its accelerator detected, moe-lm's training code, the compiled CPU kernels), so that a rank
starts in milliseconds instead of importing it all again."""

import deepspeed  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401  (a training step loads it: DeepSpeed's engine asks whether it is compiling)
from deepspeed.accelerator import get_accelerator

import moe_lm.cli.train  # noqa: F401  (the training loop, DeepSpeed's engine and the research variants)
from moe_lm.console import quiet_deepspeed
from moe_lm.ops.cpu_kernels import load_cpu_kernels

get_accelerator()  # why: detected once here, inherited by every rank (detection prints a warning on CPU)
quiet_deepspeed()
load_cpu_kernels()
