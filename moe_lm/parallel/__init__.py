"""Everything distributed: the process group, the DeepSpeed JSON derived from our config and the engine, expert
parallelism applied to a built model from outside, and the all-to-all dispatcher."""

from moe_lm.console import quiet_deepspeed

quiet_deepspeed()  # why here: before any module of this package imports deepspeed (its notices come at import)
