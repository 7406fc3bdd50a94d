"""Export a model to a Hugging Face `transformers` checkpoint (MLA -> DeepseekV3ForCausalLM, GQA -> Glm4MoeForCausalLM).

    moe-lm export --run runs/tiny --out exports/tiny-hf                    # a run's latest checkpoint + tokenizer
    moe-lm export --run runs/tiny:step_00000500 --out exports/tiny-500     # a given checkpoint
    moe-lm export --config tiny --out exports/random                       # random initialisation (for testing)

Checkpoints of any parallel.ep_size export the same model, in the layout DeepSeek publishes (so vLLM and SGLang
read it as transformers does). With --run the run's tokenizer is written beside it: AutoTokenizer loads it, and
calling it with special tokens (the default) puts the token every training document began with first. The same as
`python launch/export_hf.py`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from moe_lm.checkpoint.format import checkpoint_folder
from moe_lm.cli import main_of, output_folder
from moe_lm.cli.options import CONFIG, add_out, add_run, preset_path
from moe_lm.errors import UserError


def add_arguments(ap: argparse.ArgumentParser) -> None:
    src = ap.add_mutually_exclusive_group(required=True)
    add_run(ap, required=False, group=src)
    src.add_argument("--config", metavar=CONFIG, help="a preset or a YAML file: export a randomly initialised model")
    add_out(ap, "the export folder (created): safetensors, config.json, generation_config.json, tokenizer")
    ap.add_argument("--max-shard-size", help="safetensors shards of at most this size with an index, e.g. 5GB")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="with --config only: dotted overrides")


def run(args: argparse.Namespace) -> None:
    if args.run and args.overrides:
        raise UserError(
            f"overrides ({' '.join(args.overrides)}) apply to --config only: a run's checkpoint is exported as it "
            "was trained"
        )
    out = output_folder(args, "export")
    from moe_lm.config import load_config
    from moe_lm.interop.hf import export_bytes, export_hf, export_run

    if args.run:
        checkpoint = checkpoint_folder(*args.run)
        cfg = load_config(checkpoint / "config.yaml")
        with out.staged(needed_bytes=export_bytes(cfg.model)) as folder:
            _, said = export_run(args.run.run, checkpoint.name, folder, tokenizer_required=False,
                                 max_shard_size=args.max_shard_size)  # fmt: skip
        print(f"wrote {said} to {out.path}", file=sys.stderr if said.startswith("no tokenizer") else sys.stdout)
    else:
        from moe_lm.model import initial_model

        cfg = load_config(preset_path(args.config), args.overrides)
        with out.staged(needed_bytes=export_bytes(cfg.model)) as folder:
            export_hf(initial_model(cfg.model, cfg.seed).eval(), folder, max_shard_size=args.max_shard_size)
    print(f"wrote {out.path} (load it with transformers.AutoModelForCausalLM.from_pretrained('{out.path}'))")


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    main_of(sys.modules[__name__], prog, argv)


if __name__ == "__main__":
    main(prog="python -m moe_lm.cli.export")
