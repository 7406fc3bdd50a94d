"""Flags with one meaning in every command.

--config NAME|FILE   a preset shipped in the package (`tiny`, `gpu_1b`, ...; `moe-lm config --list`) or a YAML file
KEY=VALUE ...        dotted overrides of the config (`optim.lr=1e-3 model.moe.n_routed_experts=16`)
--print-config       print the resolved config (YAML) and exit
--run RUN[:TAG]      a run folder to read (its newest complete checkpoint, or checkpoint TAG)
--out DIR            the folder the command writes: checked before anything slow, written whole beside it and renamed
                     into place; a folder it did not write is refused (--force moves it aside, nothing is deleted)
--verbose, --debug   the libraries' INFO lines and banners; the traceback of an error
"""

from __future__ import annotations

import argparse
import sys

import yaml

from moe_lm.checkpoint.format import parse_run
from moe_lm.config import Config, config_to_dict, config_warnings, load_config, preset_path

DEFAULT_PRESET = "tiny"
CONFIG = "NAME|FILE"


def add_config(ap: argparse.ArgumentParser, default: str | None = DEFAULT_PRESET, out: str | None = None) -> None:
    """--config, the overrides and --print-config; with `out` (a dotted key) also --out as a short hand for it."""
    ap.add_argument("--config", default=default, metavar=CONFIG, help="a preset (moe-lm config --list) or a YAML file")
    if out:
        add_out(ap, f"the folder to write (sets {out})", required=False, force=False)
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides, e.g. optim.lr=1e-3")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config (YAML) and exit")
    ap.set_defaults(out_key=out)


def load(args: argparse.Namespace) -> Config:
    """The config the flags name: preset or file, overrides, --out; with --print-config it is printed and the
    command ends here."""
    overrides = list(args.overrides)
    if getattr(args, "out_key", None) and args.out:
        overrides.append(f"{args.out_key}={args.out}")
    cfg = load_config(preset_path(args.config), overrides)
    if args.print_config:
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        for warning in config_warnings(cfg):
            print(f"# {warning}")
        sys.exit(0)
    return cfg


def add_run(ap, required: bool = True, group=None) -> None:
    (group or ap).add_argument(
        "--run", type=parse_run, required=required, metavar="RUN[:TAG]",
        help="a run folder (its newest complete checkpoint), or RUN:TAG for checkpoint TAG",
    )  # fmt: skip


def add_out(ap, help: str, required: bool = True, default: str | None = None, force: bool = True) -> None:
    """--out DIR, and (`force`) --force for a command that writes the folder whole (moe_lm/output_folder.py)."""
    ap.add_argument("--out", required=required, default=default, metavar="DIR", help=help)
    if force:
        ap.add_argument(
            "--force", action="store_true",
            help="write --out even if it holds files this command did not write: that folder is moved aside to "
            "DIR.prev-<time> (nothing is deleted)",
        )  # fmt: skip


def utf8_text(value: str) -> str:
    """An argparse type for text a tokenizer encodes: the shell may pass bytes that are not UTF-8 (Python keeps them
    as lone surrogates, which no tokenizer takes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("holds bytes that are not UTF-8 text; give it in UTF-8") from None
    return value
