"""Benchmark preparation's tokenizing pass: 1 and 2 worker processes against the tokenizer's encode speed.
The same as `python -m moe_lm.bench prepare` (whose --help lists the flags and says more):

    python launch/bench_prepare.py                              # the embedded corpus, its trained tokenizer
    python launch/bench_prepare.py --repeat 2                   # a shorter stream (start-up weighs more)
"""

import sys

from moe_lm.cli.bench import main

if __name__ == "__main__":
    main(["prepare", *sys.argv[1:]])
