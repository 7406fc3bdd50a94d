"""Export a model to a Hugging Face `transformers` checkpoint (MLA -> DeepseekV3ForCausalLM, GQA -> Glm4MoeForCausalLM)
and/or to a GGUF file for llama.cpp, Ollama and LM Studio (MLA -> deepseek2, GQA -> glm4moe).

    moe-lm export --run runs/tiny --out exports/tiny-hf                    # a run's latest checkpoint + tokenizer
    moe-lm export --run runs/tiny:step_00000500 --out exports/tiny-500     # a given checkpoint
    moe-lm export --config tiny --out exports/random                       # random initialisation (for testing)
    moe-lm export --run runs/tiny --gguf exports/tiny.gguf                 # GGUF (f32; --gguf-type f16|bf16|q8_0)
    moe-lm export --hf exports/tiny-hf --gguf exports/tiny-q8.gguf --gguf-type q8_0   # from an HF export

Checkpoints of any parallel.ep_size export the same model, in the layout DeepSeek publishes (so vLLM and SGLang
read it as transformers does). With --run the run's tokenizer is written beside it: AutoTokenizer loads it, and
calling it with special tokens (the default) puts the token every training document began with first. The GGUF
file holds the tokenizer as llama.cpp's sentencepiece vocabulary, the start token added first as in training; the
MTP modules are left out (docs/serving.md). The same as `python launch/export_hf.py`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from moe_lm.checkpoint.format import checkpoint_folder
from moe_lm.cli import main_of, output_folder
from moe_lm.cli.options import CONFIG, add_out, add_run, preset_path
from moe_lm.errors import UserError, require
from moe_lm.output_folder import OutputFolder

# written with gguf-py; then the k-quants, which llama.cpp's quantiser makes from an f32 file
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q2_K", "q3_K_S", "q3_K_M", "q3_K_L", "q4_K_S", "q4_K_M", "q5_K_S",
              "q5_K_M", "q6_K")  # fmt: skip


def add_arguments(ap: argparse.ArgumentParser) -> None:
    src = ap.add_mutually_exclusive_group(required=True)
    add_run(ap, required=False, group=src)
    src.add_argument("--config", metavar=CONFIG, help="a preset or a YAML file: export a randomly initialised model")
    src.add_argument("--hf", metavar="DIR", help="an HF export folder (moe-lm export --out): write it as --gguf")
    add_out(ap, "the export folder (created): safetensors, config.json, generation_config.json, tokenizer",
            required=False)  # fmt: skip
    ap.add_argument("--gguf", metavar="FILE", help="also (or only) write a GGUF file for llama.cpp")
    ap.add_argument("--gguf-type", default="f32", choices=GGUF_TYPES, metavar="TYPE",
                    help=f"the GGUF tensors' type: {', '.join(GGUF_TYPES)} (the k-quants by llama.cpp's own quantiser, "
                    "the llama extra)")  # fmt: skip
    ap.add_argument("--max-shard-size", help="safetensors shards of at most this size with an index, e.g. 5GB")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="with --config only: dotted overrides")


def run(args: argparse.Namespace) -> None:
    if args.run and args.overrides:
        raise UserError(
            f"overrides ({' '.join(args.overrides)}) apply to --config only: a run's checkpoint is exported as it "
            "was trained"
        )
    if not (args.out or args.gguf):
        raise UserError("give --out DIR (an HF export), --gguf FILE (a GGUF file), or both")
    if args.hf and args.out:
        raise UserError("--hf is an HF export already: give --gguf FILE to write it as GGUF")
    # why both checked first: a bad --out or --gguf should fail before the model is loaded
    out = output_folder(args, "export") if args.out else None
    gguf = OutputFolder(args.gguf, "export", force=args.force, flag="--gguf", file=True) if args.gguf else None
    from moe_lm.config import load_config
    from moe_lm.interop.gguf import OUT_TYPES, hf_parameter_count, needed_bytes, write_gguf
    from moe_lm.interop.hf import export_bytes
    from moe_lm.model.architectures import count_params

    cfg, tag = None, None
    if args.run:
        checkpoint = checkpoint_folder(*args.run)  # resolved once: a running training may rotate `latest` on
        tag, cfg = checkpoint.name, load_config(checkpoint / "config.yaml")
    elif args.config:
        cfg = load_config(preset_path(args.config), args.overrides)
    if out is not None:
        with out.staged(needed_bytes=export_bytes(cfg.model)) as folder:
            said = write_hf(args, cfg, tag, folder)
        if said:
            print(f"wrote {said} to {out.path}", file=sys.stderr if said.startswith("no tokenizer") else sys.stdout)
        print(f"wrote {out.path} (load it with transformers.AutoModelForCausalLM.from_pretrained('{out.path}'))")
    if gguf is None:
        return
    n = count_params(cfg.model).total if cfg else hf_parameter_count(Path(args.hf))
    quantised = args.gguf_type not in OUT_TYPES
    if quantised:  # why before the model is loaded: a missing extra should not wait for it
        require("llama_cpp", "llama", f"--gguf-type {args.gguf_type} (llama.cpp's quantiser)")
    # the file, plus what is written beside it first: an HF export (not given), the f32 file a k-quant is made from
    extra = (0 if out or args.hf else 4 * n) + (needed_bytes(n, "f32") if quantised else 0)
    with gguf.staged(needed_bytes=needed_bytes(n, "q8_0" if quantised else args.gguf_type) + extra) as file:
        source = Path(args.hf) if args.hf else out.path if out else file.parent / "hf"
        if source == file.parent / "hf":  # an HF export in the staging folder, removed with it
            write_hf(args, cfg, tag, source)
        said = write_gguf(source, file, args.gguf_type)
    print(f"wrote {gguf.path}: {said}")


def write_hf(args: argparse.Namespace, cfg, tag: str | None, folder: Path) -> str | None:
    """The HF export of the run's checkpoint `tag` (what was written of its tokenizer), or of --config's random
    initialisation (None)."""
    from moe_lm.interop.hf import export_hf, export_run

    if args.run:
        return export_run(args.run.run, tag, folder, tokenizer_required=False, max_shard_size=args.max_shard_size)[1]
    from moe_lm.model import initial_model

    export_hf(initial_model(cfg).eval(), folder, max_shard_size=args.max_shard_size)
    return None


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    main_of(sys.modules[__name__], prog, argv)


if __name__ == "__main__":
    main(prog="python -m moe_lm.cli.export")
