"""Evaluate with lm-evaluation-harness (the same as `moe-lm eval`). `--help` lists the flags.

python launch/evaluate.py --run runs/tiny --tasks arc_easy --out evals/tiny
"""

from moe_lm.cli.evaluate import main

if __name__ == "__main__":
    main()
