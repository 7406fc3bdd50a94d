"""One training step under torch.profiler: the kernels that take the most time, and the share of routing,
dispatch, the expert GEMMs, attention, the loss and the optimizer. The same as `python -m moe_lm.bench profile`
(whose --help lists the flags and says more):

    python launch/bench_profile.py --config gpu_1b --device cuda --dtype bfloat16
"""

import sys

from moe_lm.cli.bench import main

if __name__ == "__main__":
    main(["profile", *sys.argv[1:]])
