"""Generate text from a run (the same as `moe-lm generate`). `--help` lists the flags.

python launch/generate.py --run runs/tiny --prompt "def main(" --max-new-tokens 100
"""

from moe_lm.cli.generate import main

if __name__ == "__main__":
    main()
