"""The benchmarks' command line (`moe-lm bench`): `<what>` picks a module of moe_lm/bench, whose
`add_arguments(parser)` declares its flags and `run(args)` does the work. Only the chosen module is imported (a
child process of `loss` starts once per measurement; `--help` stays quick).

    moe-lm bench moe --tokens 1024 --reps 3
    main(["moe", "--tokens", "1024"])          # the same, from a launch/ wrapper
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from moe_lm.cli import HelpFormatter, run
from moe_lm.flags import usable_device

# <what> -> the one line `--help` lists it with
BENCHMARKS = {
    "moe": "the MoE layer's forward+backward against a dense SwiGLU of equal active FLOPs and HF's DeepseekV3MoE",
    "loss": "the output head's loss, plain vs chunked (performance.loss_chunk): peak memory and time",
    "train": "training-step time of config variants (arms of dotted overrides), side by side",
    "decode": "decoding speed with MTP drafts against plain decoding, on a trained run",
    "routing": "routing recording (record_trace) against the same model's plain forward",
    "served": "llama.cpp decoding a GGUF with the routing callback (analyze --gguf) against without it",
    "streamed": "an HF checkpoint analysed a layer at a time within --max-memory against the whole model in memory: "
    "time, peak memory, the same experts",
    "prepare": "preparation's tokenizing pass, 1 and 2 workers, against the tokenizer's own encode",
    "profile": "one training step under torch.profiler: the top kernels, and the share of routing, dispatch, expert "
    "GEMMs, attention, the loss and the optimizer",
    "loop": "the training loop's step (DeepSpeed engine and bookkeeping) against the model step, and where the "
    "difference goes",
}


def parser(chosen: str | None = None, prog: str = "python -m moe_lm.bench") -> argparse.ArgumentParser:
    """The parser of every benchmark's name; only `chosen`'s flags are declared (its module is imported)."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Benchmarks: every variant is measured once per round, round after round, so that machine noise "
        "hits all alike; medians and ratios are printed. `--debug` shows the traceback of an error.",
    )
    subs = ap.add_subparsers(dest="what", metavar="<what>", required=True)
    for name, summary in BENCHMARKS.items():
        module = importlib.import_module(f"moe_lm.bench.{name}") if name == chosen else None
        description = module.__doc__ if module is not None else summary
        sub = subs.add_parser(name, help=summary, description=description, formatter_class=HelpFormatter)
        if module is not None:
            module.add_arguments(sub)
    return ap


def main(argv: Sequence[str] | None = None, prog: str = "python -m moe_lm.bench") -> None:
    """Parse `argv` (default: the command line) and run the benchmark it names; a user error ends the process with
    one `error:` line and exit code 2 (moe_lm.cli.run)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in argv:  # why: moe_lm.cli.run looks for it in sys.argv, which a caller's own argv need not be
        argv.remove("--debug")
        os.environ["MOE_LM_DEBUG"] = "1"
    chosen = argv[0] if argv and argv[0] in BENCHMARKS else None
    args = parser(chosen, prog).parse_args(argv)

    def bench() -> None:
        if getattr(args, "device", None):
            usable_device(args.device)
        importlib.import_module(f"moe_lm.bench.{args.what}").run(args)

    run(bench)
