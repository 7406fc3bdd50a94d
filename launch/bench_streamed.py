"""Streamed analysis of a checkpoint larger than the memory it is given, against the in-memory analysis of the
same release, side by side: peak memory, wall time, read and compute rates, the same experts.
The same as `python -m moe_lm.bench streamed` (whose --help lists the flags and says more):

    python launch/bench_streamed.py                                  # a random DeepseekV3 of 2.4 GB in float32, as FP8
    python launch/bench_streamed.py --folder /data/release --max-memory 4GiB
"""

import sys

from moe_lm.cli.bench import main

if __name__ == "__main__":
    main(["streamed", *sys.argv[1:]])
