"""Train (the same as `moe-lm train`); under DeepSpeed's launcher by hand. `--help` lists the flags.

deepspeed launch/train.py --config tiny [KEY=VALUE ...]
deepspeed --num_gpus 8 launch/train.py --config gpu_1b parallel.ep_size=8
python launch/train.py --config tiny          # one process, no launcher
"""

from moe_lm.cli.train import main

if __name__ == "__main__":
    main()
