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

from moe_lm.cli import output_dir, run
from moe_lm.config import load_config
from moe_lm.data.documents import DataError
from moe_lm.data.tokenizer import load_data_tokenizer
from moe_lm.interop.ds_checkpoint import load_model, parse_run
from moe_lm.interop.hf import export_hf
from moe_lm.interop.hf_tokenizer import export_tokenizer
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
    tok = None
    if args.run:
        cfg, model, tag = load_model(*args.run)
        try:
            tok = load_data_tokenizer(cfg.data.out_dir)
        except DataError as e:
            print(f"warning: no tokenizer exported ({e})", file=sys.stderr)
    else:
        cfg = load_config(args.config, args.overrides)
        model = initial_model(cfg.model, cfg.seed)
    bos, eos = (tok.doc_start_id, tok.eos_id) if tok else (None, None)
    export_hf(model.eval(), out, bos, eos, args.max_shard_size)
    if tok is not None:
        print(f"wrote {export_tokenizer(cfg.data.out_dir, out, max_len=cfg.model.max_seq_len)} to {out}")
    print(f"wrote {out} (load it with transformers.AutoModelForCausalLM.from_pretrained('{out}'))")


if __name__ == "__main__":
    run(main)
