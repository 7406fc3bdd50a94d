"""Train a DeepSeek-V3-style MoE language model under DeepSpeed.

    deepspeed launch/train.py --config configs/tiny.yaml [key=value ...]
    deepspeed --num_gpus 2 launch/train.py --config configs/tiny.yaml train.out_dir=runs/tiny2
    python launch/train.py --config configs/tiny.yaml          # a single process without the launcher

Re-running with the same train.out_dir resumes from its latest complete checkpoint; train.resume=false starts
afresh (moving the old run folder aside). Errors print one line; --debug (or MOE_LM_DEBUG=1) adds the traceback.
When a rank dies, one surviving rank prints which, the last step, the newest checkpoint and the command to resume.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import traceback
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from moe_lm.cli import debugging, fail
from moe_lm.config import ConfigError, load_config
from moe_lm.data.documents import DataError

if TYPE_CHECKING:
    from moe_lm.train.stop import PeerLost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    ap.add_argument("--debug", action="store_true", help="show tracebacks of errors (also MOE_LM_DEBUG=1)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=100 optim.lr=1e-3")
    args = ap.parse_args()
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        fail(str(e))

    from moe_lm.data.prepare import load_split
    from moe_lm.errors import RunError
    from moe_lm.parallel.deepspeed_setup import remove_shm_buffers, shutdown_distributed
    from moe_lm.train.loop import train
    from moe_lm.train.stop import PeerLost, Stopped

    try:
        final = train(cfg)
    except PeerLost as e:
        report_dead_peer(e)
    except (ConfigError, DataError, RunError) as e:
        fail(str(e))  # exit code 2; raised with --debug, for the traceback
    except Stopped as e:
        print(e, file=sys.stderr)
        sys.exit(e.exit_code)
    finally:
        # why on every path: DeepSpeed's CPU all-reduce buffers in /dev/shm outlive the process (docs/deepspeed.md
        # §6); unlinking a file other ranks still map is safe
        remove_shm_buffers(os.environ.get("MASTER_PORT", ""))
    shutdown_distributed()
    if int(os.environ.get("RANK", 0)) != 0 or not final:
        return
    tokens = np.asarray(load_split(cfg.data.out_dir, "train").tokens)
    h = unigram_entropy(tokens, cfg.model.vocab_size)
    per_domain = ", ".join(f"{k[5:]} {v:.3f}" for k, v in final.items() if k.startswith("loss/"))
    print(f"final validation loss {final['loss']:.3f} nats (per domain: {per_domain})")
    print(f"unigram entropy of the training corpus {h:.3f} nats; run folder {cfg.train.out_dir}")


def report_dead_peer(e: PeerLost) -> NoReturn:
    """Another rank died (`PeerLost`): one line from one rank, then exit at once."""
    from moe_lm.parallel.deepspeed_setup import remove_shm_buffers

    if debugging():
        traceback.print_exception(e)
    if e.report:
        cmd = resume_command()
        if e.checkpoint:
            then = f"to resume from it, run the same command: {cmd}"
        else:  # a run folder with a log and no checkpoint is refused on resume (checkpoint/save_resume.py)
            then = f"there is nothing to resume from; start again with: {cmd} train.resume=false"
        print(f"error: {e}; {then}", file=sys.stderr, flush=True)
    remove_shm_buffers(os.environ.get("MASTER_PORT", ""))
    sys.stdout.flush()
    # why os._exit: the process group is broken; leaving it (a barrier), or the interpreter's teardown of gloo's
    # threads and DeepSpeed's exit hooks, would hang or abort with a C++ message under the line just printed
    os._exit(1)


def resume_command() -> str:
    """The command the user started this run with, to run again: the `deepspeed ...` line of the launcher above
    this process when it can be seen (one node), else this script's own arguments. A train.resume=... override
    is left out: the point is to resume."""
    import psutil  # a DeepSpeed dependency

    ours = [a for a in sys.argv[1:] if not a.startswith(("--local_rank", "--local-rank", "train.resume="))]
    for parent in psutil.Process().parents():
        try:
            argv = parent.cmdline()
        except psutil.Error:
            continue
        for i, arg in enumerate(argv[:3]):
            if os.path.basename(arg) == "deepspeed" or arg == "deepspeed.launcher.runner":
                runner = [a for a in argv[i + 1 :] if not a.startswith("train.resume=")]
                return shlex.join(["deepspeed", *runner])
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # e.g. a multi-node launch: the launcher is on another machine
        return f"the same launcher command (running {shlex.join([sys.argv[0], *ours])})"
    return shlex.join(["python", sys.argv[0], *ours])


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the corpus' token frequencies: the loss of the best context-free predictor."""
    p = np.bincount(np.asarray(tokens), minlength=vocab_size).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


if __name__ == "__main__":
    main()
