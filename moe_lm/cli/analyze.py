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

from moe_lm.analysis.attribution_workflow import ATTRIBUTE_DTYPES
from moe_lm.analysis.requests import CHART_TOKENS, AttributionRequest, RoutingRequest
from moe_lm.analysis.subjects import RunSubject, what_they_are
from moe_lm.checkpoint.format import parse_run
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


def add_arguments(ap: argparse.ArgumentParser) -> None:
    kinds = all_kinds()
    add_subject(ap, kinds)
    add_out(ap, "the report folder (created)")
    ap.add_argument("--compare", nargs="+", default=[], metavar="SUBJECT",
                    help=f"other subjects on the same token ids, each recognised by what it is: "
                    f"{what_they_are(kinds)} (each its agreement)")  # fmt: skip
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


def check_flags(args: argparse.Namespace) -> None:
    """The flags' values and combinations, checked before anything is read."""
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


def run(args: argparse.Namespace) -> None:
    check_flags(args)
    out = output_folder(args, "analyze")  # why first: a bad --out should fail before any model is loaded
    kinds = all_kinds()
    settings = check_subject(args, kinds, args.compare)
    require("matplotlib", "analysis", "moe-lm analyze (its figures)")
    from moe_lm.analysis.attribution_workflow import drift_models, split_drift
    from moe_lm.analysis.quantised import quantised_subjects, write_quantised
    from moe_lm.analysis.routing_workflow import analyze_routing
    from moe_lm.analysis.stream_work import kept_for_resume, stream_work

    work = stream_work(out.path)
    # why the work folder outside the staging folder: what is kept of a failed analysis is said last, in one line
    with kept_for_resume(work), out.staged() as folder:
        compare = tuple(compared_request(spec, kinds, settings) for spec in args.compare)
        quantised = quantised_subjects(args.quantise, folder / "quantised", settings)
        attribution = AttributionRequest(RunSubject(run=parse_run(args.run)), folder, others=quantised + compare,
                                         dtypes=tuple(args.attribute_dtype)) if args.attribute else None  # fmt: skip
        # why before the export: a split with nothing to split is refused before the long analysis, not after it
        models = drift_models(attribution) if attribution else {}
        if args.quantise:
            write_quantised(RunSubject(run=parse_run(args.run)), quantised, folder / "quantised")
        request = from_flags(
            RoutingRequest, args, subject=subject_request(args, kinds, settings), out=folder,
            compare=compare + quantised, documents=documents_request(args), chart_tokens=tuple(args.chart_tokens),
            init_baseline=not args.no_init_baseline, layers=tuple(args.layers) if args.layers is not None else None,
            work=work,
        )  # fmt: skip
        analyze_routing(request)
        if attribution:
            split_drift(attribution, models)
            print((folder / "attribution.md").read_text(), end="")
        shutil.rmtree(folder / "quantised", ignore_errors=True)  # moe-lm's own files, in its staging folder
        figures = len(list((folder / "figures").glob("*.png")))
    tables = ", comparisons.md" if compare + quantised else ""
    print(f"wrote metrics.json, metrics.csv{tables}, routing.html and {figures} figures to {out.path}")


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    main_of(sys.modules[__name__], prog, argv)


if __name__ == "__main__":
    main(prog="python -m moe_lm.cli.analyze")
