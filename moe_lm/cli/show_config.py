"""Show configs: a resolved config as YAML, the presets shipped with the package, or the reference of every key.

moe-lm config                                  # the tiny preset, resolved (every default filled in)
moe-lm config --config gpu_1b optim.lr=1e-4    # a preset with overrides
moe-lm config --list                           # the presets
moe-lm config --reference > docs/config.md     # every key: type, default, meaning
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from moe_lm.cli import main_of
from moe_lm.cli.options import add_config, load
from moe_lm.config import PRESETS, presets


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_config(ap)
    ap.add_argument("--list", action="store_true", help="list the presets shipped with the package")
    ap.add_argument("--reference", action="store_true", help="print the reference of every key (markdown)")


def run(args: argparse.Namespace) -> None:
    if args.list:
        for name in presets():
            first = (PRESETS / f"{name}.yaml").read_text().splitlines()[0].lstrip("# ").strip()
            print(f"{name:18s} {first[:90]}{'...' if len(first) > 90 else ''}")
    elif args.reference:
        from moe_lm.config_docs import reference

        print(reference(), end="")
    else:
        args.print_config = True
        load(args)  # prints and exits


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    main_of(sys.modules[__name__], prog, argv)


if __name__ == "__main__":
    main(prog="python -m moe_lm.cli.show_config")
