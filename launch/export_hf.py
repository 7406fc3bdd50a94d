"""Export a run to a transformers checkpoint (the same as `moe-lm export`). `--help` lists the flags.

python launch/export_hf.py --run runs/tiny --out exports/tiny-hf
"""

from moe_lm.cli.export import main

if __name__ == "__main__":
    main()
