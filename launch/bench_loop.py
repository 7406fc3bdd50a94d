"""The training loop's step (DeepSpeed's engine and the loop's bookkeeping) against the model step, and with
--profile where the difference goes. The same as `python -m moe_lm.bench loop` (whose --help lists the flags and
says more):

    python launch/bench_loop.py --profile
"""

import sys

from moe_lm.cli.bench import main

if __name__ == "__main__":
    main(["loop", *sys.argv[1:]])
