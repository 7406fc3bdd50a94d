"""The output head's training loss, plain vs chunked (performance.loss_chunk): peak memory and time.
The same as `python -m moe_lm.bench loss` (whose --help lists the flags and says more):

    python launch/bench_loss.py                                      # 2048 tokens of gpu_1b's head (1024 x 32768)
    python launch/bench_loss.py --tokens 16384 --chunks 0 2048 4096 --device cuda --dtype bfloat16
"""

import sys

from moe_lm.cli.bench import main

if __name__ == "__main__":
    main(["loss", *sys.argv[1:]])
