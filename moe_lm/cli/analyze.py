"""Analyse routing: record which expert every token chose and draw the figures MoE papers report, with baselines.

    moe-lm analyze --run runs/tiny --out analysis/tiny
    moe-lm analyze --run runs/tiny --data my_corpus/ --out analysis_mine --chart-tokens . , the what
    moe-lm analyze --run runs/tiny --compare runs/tiny:step_00000250 --out analysis       # + router saturation
    moe-lm analyze --hf path/to/DeepSeek-V2-Lite --data corpus/ --out analysis_v2lite     # a released model
    moe-lm analyze --gguf model-Q4_K_M.gguf --data corpus/ --out a_q4                     # as llama.cpp runs it
    moe-lm analyze --run runs/tiny --quantise f16 q8_0 q4_K_M --out drift             # what quantising it flips
    moe-lm analyze --run runs/tiny --quantise q8_0 q4_K_M --attribute --out drift     # ... and where its loss goes
    moe-lm analyze --hf path/to/Qwen3-30B-A3B --data mmlu.jsonl --domain-field subject \
        --compare qwen3-f16.gguf qwen3-q8_0.gguf qwen3-q4_k_m.gguf --out drift           # what quantisation flips
    moe-lm analyze --routes rollouts.jsonl --served path/to/Qwen3-30B-A3B --compare path/to/Qwen3-30B-A3B \
        --out served                                                                     # an engine's routes

--run: a moe-lm run (default data: its validation split, documents with their domains); --hf: a transformers MoE
checkpoint (DeepseekV3/V2, Glm4Moe, Qwen2Moe/Qwen3Moe, OlmoE, Mixtral) with its own tokenizer, in --dtype on
--device; --gguf: a GGUF MoE file of any type (f32 ... q2_K), run in llama.cpp with its own tokenizer (the llama
extra), its experts read from llama.cpp's graph; --routes: the routes an engine recorded (vLLM's or SGLang's
responses with routed experts, SGLang's per-token dumps, Megatron-Core's router trace with the trainer's tokens),
its own sequences the documents, with --served, the checkpoint it served (the kinds of subject:
moe_lm/analysis/subjects/). --compare: other subjects routing the very same token ids in the same windows (a
checkpoint RUN[:TAG], an HF folder, a GGUF file, each recognised by what it is): their agreement with this one per
layer and domain, in comparisons.md and the report. --quantise: the run exported as GGUF at each type, each file run
in llama.cpp and compared the same way (the files are deleted afterwards; `moe-lm export --gguf-type` keeps one).
--data takes .txt/.jsonl files or folders (a sub-folder per domain), parquet, hf:NAME, tokenised with the subject's
tokenizer. Writes into --out: trace/ (the recorded routing), trace_init/ (the same tokens through the untrained
model: baseline N1; none for a GGUF file), trace_compare_<i>/, figures/*.png, routing.html, metrics.json and
metrics.csv; with --wandb, logs the figures to the run's own wandb run too. The token budget (--max-tokens) is
spread equally over the domains. The same as `python launch/analyze_routing.py`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from moe_lm.analysis.requests import CHART_TOKENS, RoutingRequest
from moe_lm.analysis.subjects import GGUFSubject, SubjectRequest
from moe_lm.cli import main_of, output_folder
from moe_lm.cli.export import GGUF_TYPES
from moe_lm.cli.options import add_out, utf8_text
from moe_lm.cli.subject import (
    add_subject,
    all_kinds,
    check_subject,
    compared_request,
    documents_request,
    subject_request,
)
from moe_lm.errors import UserError, require
from moe_lm.flags import default_of, from_flags

ATTRIBUTE_DTYPES = ("bfloat16", "float16")  # the run's other dtypes that --attribute-dtype splits against float32


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_subject(ap, all_kinds())
    add_out(ap, "the report folder (created)")
    ap.add_argument(
        "--compare", nargs="+", default=[], metavar="SUBJECT",
        help="other subjects on the same token ids: RUN[:TAG], an HF folder, or a GGUF file (each its agreement)",
    )  # fmt: skip
    ap.add_argument(
        "--quantise",
        nargs="+",
        default=[],
        choices=GGUF_TYPES,
        metavar="TYPE",
        help=f"with --run: compare the run exported as GGUF at each TYPE ({', '.join(GGUF_TYPES)})",
    )
    ap.add_argument("--attribute", action="store_true",
                    help="with --run: split the log-prob change of each --quantise type and each compared model of "
                    "the run's architecture (a checkpoint, a transformers folder, a GGUF file) into weights and "
                    "routing (flips and gate values), in both orders and their average (its weights in the run's "
                    "architecture, the routes forced; attribution.md)")  # fmt: skip
    ap.add_argument("--attribute-dtype", nargs="+", default=[], choices=ATTRIBUTE_DTYPES, metavar="DTYPE",
                    help=f"with --run: also split the drift of the run itself computed in DTYPE "
                    f"({', '.join(ATTRIBUTE_DTYPES)}) against float32 (implies --attribute)")  # fmt: skip
    ap.add_argument("--chart-tokens", nargs="*", default=list(CHART_TOKENS), metavar="TOKEN", type=utf8_text,
                    help="tokens whose routing across layers is charted")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=default_of(RoutingRequest, "max_tokens"),
                    help="tokens recorded, spread equally over the domains")  # fmt: skip
    ap.add_argument("--batch-size", type=int, default=default_of(RoutingRequest, "batch_size"), metavar="N",
                    help="sequences per forward pass")  # fmt: skip
    ap.add_argument("--min-count", type=int, default=default_of(RoutingRequest, "min_count"),
                    help="minimum occurrences for vocabulary specialisation")  # fmt: skip
    ap.add_argument("--no-init-baseline", action="store_true", help="skip the untrained-model baseline (N1)")
    ap.add_argument(
        "--layers", nargs="*", type=int, metavar="LAYER", help="MoE layers to draw and tabulate (default: all up to "
        "8 MoE layers, else the first, middle and last; the metrics cover every layer)",
    )  # fmt: skip
    ap.add_argument("--wandb", action="store_true", help="also log the figures to the run's own wandb run")


def run(args: argparse.Namespace) -> None:
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1 sequence, got {args.batch_size}")
    if args.min_count < 2:  # why: an id seen once has the chance level of a perfect specialist (0/0 corrected)
        raise UserError(f"--min-count must be at least 2 occurrences, got {args.min_count}")
    if args.quantise and not args.run:
        raise UserError("--quantise exports a moe-lm run as GGUF: give the run as --run RUN[:TAG]")
    args.attribute = args.attribute or bool(args.attribute_dtype)
    if args.attribute and not (args.run and (args.quantise or args.compare or args.attribute_dtype)):
        raise UserError("--attribute splits what another model of the run's architecture changes: give --run RUN and "
                        "--quantise TYPE ..., --compare CHECKPOINT|HF_FOLDER|GGUF ... or --attribute-dtype "
                        "DTYPE")  # fmt: skip
    out = output_folder(args, "analyze")  # why first: a bad --out should fail before any model is loaded
    kinds = all_kinds()
    check_subject(args, kinds)
    require("matplotlib", "analysis", "moe-lm analyze (its figures)")
    from moe_lm.analysis.routing_workflow import analyze_routing
    from moe_lm.analysis.stream_work import kept_for_resume, stream_work

    args.stream_work = str(stream_work(out.path))
    # why the work folder outside the staging folder: what is kept of a failed analysis is said last, in one line
    with kept_for_resume(Path(args.stream_work)), out.staged() as folder:
        # why before the export: a split with nothing to split is refused before the long analysis, not after it
        others = attributed_models(args, folder) if args.attribute else {}
        compare = tuple(compared_request(spec, args, kinds) for spec in args.compare)
        compare += quantised_subjects(args, folder / "quantised")
        request = from_flags(
            RoutingRequest, args, subject=subject_request(args, kinds), out=folder, compare=compare,
            documents=documents_request(args), chart_tokens=tuple(args.chart_tokens),
            init_baseline=not args.no_init_baseline, layers=tuple(args.layers) if args.layers is not None else None,
        )  # fmt: skip
        result = analyze_routing(request)
        if args.attribute:
            attribute(args, others, folder)
        if args.wandb:
            log_to_wandb(request.subject, folder, result)
        shutil.rmtree(folder / "quantised", ignore_errors=True)  # moe-lm's own files, in its staging folder
        figures = len(list((folder / "figures").glob("*.png")))
    tables = ", comparisons.md" if compare else ""
    print(f"wrote metrics.json, metrics.csv{tables}, routing.html and {figures} figures to {out.path}")


def attributed_models(args: argparse.Namespace, folder: Path) -> dict:
    """--attribute: label -> a builder of each model whose drift splits (each quantised file, the run in each
    --attribute-dtype, each compared model whose weights run in the run's architecture); those that cannot are
    named and left out, and a UserError when none is left."""
    from moe_lm.checkpoint.format import checkpoint_folder, parse_run
    from moe_lm.config import load_config

    # why: GGUF weights read back only into MLA runs (moe_lm/interop/gguf_weights.py)
    attention = load_config(checkpoint_folder(*parse_run(args.run)) / "config.yaml").model.attention
    quantised = {kind: str(quantised_file(folder / "quantised", kind)) for kind in args.quantise}  # not written yet
    others = {f"{args.run} in {dtype}": in_dtype(args.run, dtype) for dtype in args.attribute_dtype}
    for label, spec in (quantised | {spec: spec for spec in args.compare}).items():
        gguf = label in quantised or is_gguf_file(spec)
        build = weights_in_architecture(spec, gguf)
        if gguf and attention != "mla":
            print(f"--attribute: {label} is not split (a GGUF file's weights are read back into MLA runs only; "
                  f"{args.run} is {attention})")  # fmt: skip
        elif build is None:
            print(f"--attribute: {spec} is not split (its weights do not run in the run's architecture: a moe-lm "
                  "checkpoint, a DeepseekV3 transformers folder or a GGUF file of the run's shape do)")  # fmt: skip
        else:
            others[label] = build
    if not others:
        raise UserError(f"--attribute: no compared model runs in the architecture of {args.run}; give --quantise TYPE "
                        "(MLA runs), --attribute-dtype DTYPE or --compare CHECKPOINT|HF_FOLDER|GGUF of the run's "
                        "shape, or drop --attribute")  # fmt: skip
    return others


def attribute(args: argparse.Namespace, others: dict, folder: Path) -> None:
    """--attribute: the drift of each model of `attributed_models` split into weights and routing on the trace's
    documents."""
    from moe_lm.analysis.attribution import attribute_models
    from moe_lm.analysis.trace import Trace
    from moe_lm.checkpoint.format import parse_run

    try:
        attribute_models(parse_run(args.run), Trace(folder / "trace"), others, folder)
    except ValueError as e:
        raise UserError(f"--attribute {e}") from None
    print((folder / "attribution.md").read_text(), end="")


def in_dtype(run: str, dtype: str):
    """A function of the run's ModelConfig that builds the run's own model with weights and compute in `dtype`."""
    import torch

    from moe_lm.checkpoint.format import load_model, parse_run

    return lambda cfg: load_model(*parse_run(run))[1].to(getattr(torch, dtype))


def is_gguf_file(spec: str) -> bool:
    from moe_lm.interop.gguf_header import is_gguf

    return Path(spec).is_file() and is_gguf(Path(spec))


def weights_in_architecture(spec: str, gguf: bool = False):
    """A function of the run's ModelConfig that builds `spec`'s weights as our Transformer (a GGUF file dequantised,
    also one still to be written with `gguf`; a moe-lm checkpoint; a DeepseekV3 transformers folder imported), or
    None for anything else."""
    from moe_lm.analysis.subjects.hf import hf_config
    from moe_lm.checkpoint.format import load_model, parse_run
    from moe_lm.interop.gguf_weights import model_from_gguf
    from moe_lm.interop.hf import import_hf
    from moe_lm.interop.hf_layers import HFCheckpoint

    path = Path(spec)
    if gguf or is_gguf_file(spec):
        return lambda cfg: model_from_gguf(path, cfg)
    if (parse_run(spec).run / "checkpoints").is_dir():
        return lambda cfg: load_model(*parse_run(spec))[1]
    if (path / "config.json").is_file() and hf_config(spec).model_type == "deepseek_v3":
        # why moe-lm's reader, not from_pretrained: the weights the comparison ran (an FP8 release dequantised by
        # DeepSeek's rule in float32; transformers' CPU path rounds it to bf16 and misreads ragged blocks)
        return lambda cfg: import_hf(path, HFCheckpoint(path, hf_config(spec)).model())
    return None


def quantised_subjects(args: argparse.Namespace, folder: Path) -> tuple[SubjectRequest, ...]:
    """--quantise: the run written once as an HF export, then as a GGUF file of each type (moe_lm/interop: what
    `moe-lm export` runs), each to be run in llama.cpp and named by its type in the report."""
    if not args.quantise:
        return ()
    from moe_lm.checkpoint.format import parse_run
    from moe_lm.interop.gguf import write_gguf
    from moe_lm.interop.hf import export_run

    export_run(*parse_run(args.run), folder / "hf", tokenizer_required=False)
    subjects = []
    for kind in args.quantise:
        file = quantised_file(folder, kind)
        write_gguf(folder / "hf", file, kind)
        subjects.append(GGUFSubject(str(file), name=kind, threads=args.threads, seq_len=args.seq_len,
                                    llama_defaults=args.llama_defaults))  # fmt: skip
    return tuple(subjects)


def quantised_file(folder: Path, kind: str) -> Path:
    return folder / f"model-{kind}.gguf"


def log_to_wandb(subject: SubjectRequest, report: Path, result: dict) -> None:
    """--wandb: the report's figures and per-domain shares, attached to the run's own wandb run (offline runs sync
    later); only a moe-lm run has one."""
    if subject.kind != "run":
        print("warning: --wandb: only a moe-lm run has a wandb run to log to", file=sys.stderr)
        return
    from moe_lm.checkpoint.format import checkpoint_folder
    from moe_lm.config import load_config
    from moe_lm.train.tracker import open_wandb

    run, tag = subject.run
    wandb = open_wandb(load_config(checkpoint_folder(run, tag) / "config.yaml").logging, run, create=False)
    if wandb is None:
        return
    data = {f"routing/{p.stem}": wandb.Image(str(p)) for p in sorted((report / "figures").glob("*.png"))}
    domains = result["trace"]["domains"]
    table = wandb.Table(columns=["layer", "domain", "expert", "token_share", "relative_load"])
    for layer, lm in result["layers"].items():
        for d, name in enumerate(domains):
            for e, share in enumerate(lm["domain_token_share"][d]):
                table.add_data(int(layer), name, e, share, lm["domain_relative_load"][d][e])
    data["routing/domain_shares"] = table
    wandb.log(data)
    wandb.finish()


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    main_of(sys.modules[__name__], prog, argv)


if __name__ == "__main__":
    main(prog="python -m moe_lm.cli.analyze")
