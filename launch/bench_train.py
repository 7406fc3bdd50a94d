"""Training-step throughput of config variants, side by side: what a feature costs per optimizer step.
The same as `python -m moe_lm.bench train` (whose --help lists the flags and says more):

    python launch/bench_train.py --config configs/tiny.yaml --arms model.mtp.depth=0 model.mtp.depth=1
    python launch/bench_train.py --config configs/tiny.yaml --arms "" "performance.activation_checkpointing=full" \
        "performance.compile=true" --rounds 12
"""

import sys

from moe_lm.cli.bench import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])
