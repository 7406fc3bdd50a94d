"""Run an experiment (the same as `moe-lm experiment`). `--help` lists the flags.

python launch/experiment.py moe-dense
"""

from moe_lm.cli.experiment import main

if __name__ == "__main__":
    main()
