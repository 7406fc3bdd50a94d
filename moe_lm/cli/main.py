"""moe-lm: train and study DeepSeek-V3-style Mixture-of-Experts language models.

    moe-lm prepare          prepare data: corpus, tokenizer, token shards
    moe-lm train            train under DeepSpeed (one process, or --nproc N)
    ...                     (every command: moe-lm <command> --help)

A run's folder is read with --run RUN[:TAG]; every command writes to --out; a config is --config NAME|FILE plus
dotted KEY=VALUE overrides. Documentation: README.md and docs/.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from moe_lm.cli import HelpFormatter, command_parser, start

# command -> (its module in moe_lm.cli, what it does); only the module named is imported, so --help stays quick
COMMANDS = {
    "prepare": ("prepare", "prepare data: read sources, train or copy the tokenizer, write token shards"),
    "train": ("train", "train a model under DeepSpeed (resumes a run folder; --nproc N processes)"),
    "generate": ("generate", "generate text from a run (KV-cached; --speculative mtp drafts with MTP modules)"),
    "export": (
        "export",
        "export a run as a transformers checkpoint (DeepseekV3 / Glm4Moe) with its tokenizer, and/or "
        "as a GGUF file for llama.cpp (f32 ... q2_K)",
    ),
    "eval": ("evaluate", "evaluate a run or an export with lm-evaluation-harness"),
    "analyze": (
        "analyze",
        "analyse the routing of a run, a transformers MoE checkpoint or a GGUF file in llama.cpp, "
        "with baselines; compare subjects token by token",
    ),
    "ablate": ("ablate", "route around experts and measure each domain's loss change"),
    "prune": (
        "prune",
        "remove the least salient routed experts of a run (reap, frequency, gate-mass, ablation) "
        "and write the smaller model as a run",
    ),
    "experiment": ("experiment", "run an experiment (arms x seeds) and write its report with a verdict"),
    "bench": (None, "benchmarks: MoE layer, loss, training step, decoding, routing, preparation (moe_lm.bench)"),
    "estimate": (
        "estimate",
        "plan a layout: memory per GPU, pipeline stages, the expert-parallel all-to-all (also from a routing trace)",
    ),
    "config": ("show_config", "show a resolved config, the presets, or the reference of every key"),
}


def parser(chosen: str | None) -> argparse.ArgumentParser:
    """The `moe-lm` parser; only `chosen`'s flags are declared (its module imported)."""
    ap = argparse.ArgumentParser(
        prog="moe-lm", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
        epilog="moe-lm <command> --help shows a command's flags with their defaults.",
    )  # fmt: skip
    subs = ap.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, (module, summary) in COMMANDS.items():
        sub = subs.add_parser(name, help=summary, description=summary)
        if name == chosen and module:
            command_parser(importlib.import_module(f"moe_lm.cli.{module}"), sub)
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    if chosen == "bench":
        from moe_lm.cli.bench import main as bench

        bench(argv[1:], prog="moe-lm bench")
        return
    args = parser(chosen).parse_args(argv)
    start(importlib.import_module(f"moe_lm.cli.{COMMANDS[args.command][0]}"), args)


if __name__ == "__main__":
    main()
