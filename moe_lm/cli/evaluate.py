"""Evaluate downstream tasks with EleutherAI's lm-evaluation-harness, on a run or an export (the eval extra).

    moe-lm eval --run runs/tiny --tasks hellaswag,arc_easy --out evals/tiny                  # latest checkpoint
    moe-lm eval --run runs/tiny:step_00000500 --tasks mmlu_high_school_computer_science --num-fewshot 5 --out evals/t
    moe-lm eval --model exports/tiny-hf --tasks my_tasks/qa.yaml --out evals/qa               # a task YAML file
    moe-lm eval --model exports/tiny-hf --include-path my_tasks --tasks qa,qa_hard --out evals/qa

--run exports the checkpoint with its tokenizer into a temporary folder under --out (as `moe-lm export` does) and
evaluates that; --model takes an existing export. Each context is scored after the token every training document
began with (docs/interop.md). Writes <out>/results.json (lm-eval's results, per-task configs and versions) and with
--log-samples <out>/samples_<task>.jsonl. The same as `python launch/evaluate.py`.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from moe_lm.cli import main_of, output_folder
from moe_lm.cli.options import add_out, add_run
from moe_lm.errors import UserError, install_hint
from moe_lm.flags import torch_device, usable_device


def add_arguments(ap: argparse.ArgumentParser) -> None:
    src = ap.add_mutually_exclusive_group(required=True)
    add_run(ap, required=False, group=src)
    src.add_argument("--model", metavar="DIR", help="a folder written by `moe-lm export`")
    ap.add_argument("--tasks", required=True, help="comma list of lm-eval task names, glob patterns or task YAML files")
    ap.add_argument("--include-path", metavar="DIR", help="a folder of your own task YAMLs that --tasks may name")
    add_out(ap, "the results folder (created): results.json, samples_<task>.jsonl")
    ap.add_argument("--limit", type=float, help="at most this many documents per task (< 1: a fraction); for tests")
    ap.add_argument("--num-fewshot", type=int, help="few-shot examples per context (default: each task's own)")
    ap.add_argument("--batch-size", default="1", metavar="N", help="sequences per forward pass, or 'auto' (GPU)")
    ap.add_argument("--device", default="cpu", type=torch_device, help="cpu, cuda, cuda:1, ...")
    ap.add_argument("--dtype", default="auto", help="weights' dtype: auto (the export's), float32, bfloat16, ...")
    ap.add_argument("--log-samples", action="store_true", help="also write each document's requests and scores")
    ap.add_argument("--seed", type=int, default=0, help="seed of few-shot sampling")


def check(args: argparse.Namespace) -> None:
    if args.limit is not None and not args.limit > 0:
        raise UserError(f"--limit must be > 0 (a count, or a fraction below 1), got {args.limit}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    if args.batch_size != "auto" and not (args.batch_size.isdigit() and int(args.batch_size) > 0):
        raise UserError(f"--batch-size must be a positive integer or 'auto', got {args.batch_size}")
    usable_device(args.device)
    if args.include_path and not Path(args.include_path).is_dir():
        raise UserError(f"--include-path {args.include_path}: not a folder (give the folder holding your task YAMLs)")


def run(args: argparse.Namespace) -> None:
    check(args)
    out = output_folder(args, "eval")  # why first: a bad --out should fail before minutes of export and loading
    if importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("accelerate") is None:
        raise UserError(f"evaluation needs lm-evaluation-harness and accelerate: {install_hint('eval')}")
    from lm_eval.utils import make_table

    from moe_lm.interop.lm_eval import EvalRequest, evaluate_export_or_run

    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    with out.staged() as folder:
        request = EvalRequest(tuple(tasks), args.model, args.run, args.include_path, limit, args.num_fewshot,
                              args.batch_size, args.device, args.dtype, args.log_samples, args.seed)  # fmt: skip
        results, written = evaluate_export_or_run(request, folder)
    print(make_table(results))
    for path in written:
        print(f"wrote {out.final(path)}")


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    main_of(sys.modules[__name__], prog, argv)


if __name__ == "__main__":
    main(prog="python -m moe_lm.cli.evaluate")
