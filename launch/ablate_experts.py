"""Ablate experts (the same as `moe-lm ablate`). `--help` lists the flags.

python launch/ablate_experts.py --run runs/tiny --out ablation/tiny
"""

from moe_lm.cli.ablate import main

if __name__ == "__main__":
    main()
