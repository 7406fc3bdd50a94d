"""Prepare data (the same as `moe-lm prepare`). `--help` lists the flags.

python launch/prepare_data.py --config tiny data.sources=[corpus/] --out data/mine
"""

from moe_lm.cli.prepare import main

if __name__ == "__main__":
    main()
