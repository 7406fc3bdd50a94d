"""Export a model to a Hugging Face `transformers` checkpoint (MLA -> DeepseekV3ForCausalLM, GQA -> Glm4MoeForCausalLM).

    python launch/export_hf.py --run runs/tiny --out exports/tiny-hf                  # a run's latest checkpoint
    python launch/export_hf.py --run runs/tiny:step_00000500 --out exports/tiny-500   # a given checkpoint
    python launch/export_hf.py --config configs/tiny.yaml --out exports/random        # random init (for testing)

Checkpoints of any parallel.ep_size export the same model, in the layout DeepSeek publishes (so vLLM and SGLang
read it as transformers does). With --run the run's tokenizer is written beside it: AutoTokenizer loads it, and
calling it with special tokens (the default) puts the token every training document began with first.
"""

from __future__ import annotations

import argparse
import sys

from moe_lm.checkpoint.format import parse_run
from moe_lm.cli import output_dir, run
from moe_lm.config import load_config
from moe_lm.interop.hf import export_hf, export_run
from moe_lm.model import initial_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", type=parse_run, help="a run folder, optionally RUN:TAG for a specific checkpoint")
    src.add_argument("--config", help="a YAML preset: export a randomly initialised model")
    ap.add_argument("--out", required=True, help="output folder (created): safetensors, config.json, tokenizer")
    ap.add_argument("--max-shard-size", help="safetensors shards of at most this size with an index, e.g. 5GB")
    ap.add_argument("overrides", nargs="*", help="with --config only: dotted overrides, e.g. model.dim=256")
    args = ap.parse_args()
    if args.run and args.overrides:
        ap.error(
            f"overrides ({' '.join(args.overrides)}) apply to --config only: a run's checkpoint is exported as it "
            "was trained"
        )
    out = output_dir(args.out)
    if args.run:
        _, said = export_run(*args.run, out, tokenizer_required=False, max_shard_size=args.max_shard_size)
        print(f"wrote {said} to {out}", file=sys.stderr if said.startswith("no tokenizer") else sys.stdout)
    else:
        cfg = load_config(args.config, args.overrides)
        export_hf(initial_model(cfg.model, cfg.seed).eval(), out, max_shard_size=args.max_shard_size)
    print(f"wrote {out} (load it with transformers.AutoModelForCausalLM.from_pretrained('{out}'))")


if __name__ == "__main__":
    run(main)
