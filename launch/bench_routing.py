"""Benchmark routing recording against the same model's plain forward, in the same run.
The same as `python -m moe_lm.bench routing` (whose --help lists the flags and says more):

    python launch/bench_routing.py                                   # a small random DeepseekV3, CPU, fp32
    python launch/bench_routing.py --device cuda --dtype bfloat16 --hidden 1024 --layers 8 --experts 64
"""

import sys

from moe_lm.cli.bench import main

if __name__ == "__main__":
    main(["routing", *sys.argv[1:]])
