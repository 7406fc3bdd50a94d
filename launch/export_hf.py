"""Export a model to a Hugging Face `transformers` checkpoint (MLA -> DeepseekV3ForCausalLM, GQA -> Glm4MoeForCausalLM).

    python launch/export_hf.py --run runs/tiny --out exports/tiny-hf                  # a run's latest checkpoint
    python launch/export_hf.py --run runs/tiny:step_00000500 --out exports/tiny-500   # a given checkpoint
    python launch/export_hf.py --config configs/tiny.yaml --out exports/random        # random init (for testing)

Checkpoints of any parallel.ep_size export the same model. The run's tokenizer.model is copied alongside.
"""

from __future__ import annotations

import argparse
import sys

from moe_lm.config import ConfigError, load_config
from moe_lm.data.documents import DataError
from moe_lm.interop.ds_checkpoint import load_model, parse_run
from moe_lm.interop.hf import export_hf
from moe_lm.interop.hf_tokenizer import export_tokenizer
from moe_lm.model import initial_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", type=parse_run, help="a run folder, optionally RUN:TAG for a specific checkpoint")
    src.add_argument("--config", help="a YAML preset: export a randomly initialised model")
    ap.add_argument("--out", required=True, help="output directory (safetensors + config.json)")
    ap.add_argument("overrides", nargs="*", help="config overrides with --config, e.g. model.dim=256")
    args = ap.parse_args()
    try:
        if args.run:
            cfg, model, tag = load_model(*args.run)
        else:
            cfg = load_config(args.config, args.overrides)
            model = initial_model(cfg.model, cfg.seed)
        out = export_hf(model.eval(), args.out)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    if args.run:
        try:
            print(f"wrote {export_tokenizer(cfg.data.out_dir, out)} to {out}")
        except DataError as e:
            print(f"warning: no tokenizer exported ({e})", file=sys.stderr)
    print(f"wrote {out} (load it with transformers.AutoModelForCausalLM.from_pretrained('{out}'))")


if __name__ == "__main__":
    main()
