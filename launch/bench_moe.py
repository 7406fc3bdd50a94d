"""Benchmark the MoE layer against a dense SwiGLU of equal active FLOPs and HF's DeepseekV3MoE, side by side.
The same as `python -m moe_lm.bench moe` (whose --help lists the flags and says more):

    python launch/bench_moe.py                       # CPU fp32, the three reference shapes, T=4096
    python launch/bench_moe.py --device cuda --dtype bfloat16   # adds MegaBlocks' kernels where installed
"""

import sys

from moe_lm.cli.bench import main

if __name__ == "__main__":
    main(["moe", *sys.argv[1:]])
