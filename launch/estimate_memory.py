"""Estimate training memory per GPU (the same as `moe-lm estimate`). `--help` lists the flags.

python launch/estimate_memory.py --config gpu_1b --world 1
"""

from moe_lm.cli.estimate import main

if __name__ == "__main__":
    main()
