"""Decoding speed with MTP drafts against plain decoding, side by side, on a trained run.
The same as `python -m moe_lm.bench decode` (whose --help lists the flags and says more):

    python launch/bench_decode.py --run runs/tiny_mtp                         # greedy, 8 prompts, 128 tokens each
    python launch/bench_decode.py --run runs/tiny_mtp --temperature 0.8 --top-p 0.95
"""

import sys

from moe_lm.cli.bench import main

if __name__ == "__main__":
    main(["decode", *sys.argv[1:]])
