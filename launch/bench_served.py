"""What recording the routing costs inside llama.cpp: a GGUF decoded with and without the routing callback.
The same as `python -m moe_lm.bench served` (whose --help lists the flags and says more):

    python launch/bench_served.py --gguf model.gguf
"""

import sys

from moe_lm.cli.bench import main

if __name__ == "__main__":
    main(["served", *sys.argv[1:]])
