"""Analyse routing (the same as `moe-lm analyze`). `--help` lists the flags.

python launch/analyze_routing.py --run runs/tiny --out analysis/tiny
"""

from moe_lm.cli.analyze import main

if __name__ == "__main__":
    main()
