"""Downstream evaluation with EleutherAI's lm-evaluation-harness (pip install 'moe-lm[eval]'), on a run or an export.

    python launch/evaluate.py --run runs/tiny --tasks hellaswag,arc_easy --out evals/tiny           # latest checkpoint
    python launch/evaluate.py --run runs/tiny:step_00000500 --tasks mmlu_high_school_computer_science --num-fewshot 5 \\
        --out evals/tiny-500
    python launch/evaluate.py --model exports/tiny-hf --tasks my_tasks/qa.yaml --out evals/qa       # a task YAML file
    python launch/evaluate.py --model exports/tiny-hf --include-path my_tasks --tasks qa,qa_hard --out evals/qa

--run exports the checkpoint with its tokenizer into a temporary folder under --out (as launch/export_hf.py does)
and evaluates that; --model takes an existing export. Each context is scored after the token every training
document began with (docs/evaluation.md). Writes <out>/results.json (lm-eval's results, per-task configs and
versions) and with --log-samples <out>/samples_<task>.jsonl (each document, its requests and loglikelihoods).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

from moe_lm.checkpoint.format import parse_run
from moe_lm.cli import UserError, output_dir, run


def export_run(run_ref, out: Path) -> str:
    """Export a run's checkpoint and its tokenizer into `out`, as launch/export_hf.py --run does; returns the tag."""
    from moe_lm.interop.hf import export_run as export

    tag, said = export(run_ref.run, run_ref.tag, out)  # why required: evaluation cannot run without the tokenizer
    print(f"exported {run_ref.run}:{tag} with {said}", file=sys.stderr)
    return tag


def write_results(results: dict, out: Path) -> list[Path]:
    """<out>/results.json, and one samples_<task>.jsonl per task when samples were logged; returns the files."""
    from lm_eval.utils import handle_non_serializable

    samples = results.pop("samples", None) or {}
    written = [out / "results.json"]
    written[0].write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    for task, docs in samples.items():
        path = out / f"samples_{task}.jsonl"
        path.write_text(
            "".join(json.dumps(d, default=handle_non_serializable, ensure_ascii=False) + "\n" for d in docs)
        )
        written.append(path)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", type=parse_run, help="a run folder, or RUN:TAG for a given checkpoint (exported first)")
    src.add_argument("--model", help="a folder written by launch/export_hf.py --run")
    ap.add_argument("--tasks", required=True, help="comma list of lm-eval task names, glob patterns or task YAML files")
    ap.add_argument("--include-path", help="a folder of your own task YAMLs, whose tasks --tasks may then name")
    ap.add_argument("--out", required=True, help="output folder (created): results.json, samples_<task>.jsonl")
    ap.add_argument("--limit", type=float, help="at most this many documents per task (< 1: a fraction); for tests")
    ap.add_argument("--num-fewshot", type=int, help="few-shot examples per context (default: each task's own)")
    ap.add_argument("--batch-size", default="1", help="an integer, or 'auto' (GPU) (default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: %(default)s)")
    ap.add_argument("--dtype", default="auto", help="weights' dtype: auto (the export's), float32, bfloat16, ...")
    ap.add_argument("--log-samples", action="store_true", help="also write each document's requests and scores")
    ap.add_argument("--seed", type=int, default=0, help="seed of few-shot sampling (default: %(default)s)")
    args = ap.parse_args()
    if args.limit is not None and not args.limit > 0:
        ap.error(f"--limit must be > 0 (a count, or a fraction below 1), got {args.limit}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        ap.error(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    if args.batch_size != "auto" and not (args.batch_size.isdigit() and int(args.batch_size) > 0):
        ap.error(f"--batch-size must be a positive integer or 'auto', got {args.batch_size}")
    if args.include_path and not Path(args.include_path).is_dir():
        ap.error(f"--include-path {args.include_path}: not a folder (give the folder holding your task YAMLs)")
    out = output_dir(args.out)  # why first: a bad --out should fail before minutes of export and loading
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    if importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("accelerate") is None:
        raise UserError("evaluation needs lm-evaluation-harness and accelerate: pip install 'moe-lm[eval]'")
    from moe_lm.interop.lm_eval import document_start_id, evaluate, harness_lm, resolve_tasks

    if args.model:
        document_start_id(args.model)  # why here: a folder that is no export is named before the task index is built
    manager, tasks = resolve_tasks([t.strip() for t in args.tasks.split(",") if t.strip()], args.include_path)

    # why under --out: a big model's export needs the room the user chose for results, not /tmp's
    folder = tempfile.TemporaryDirectory(dir=out, prefix=".export-") if args.run else nullcontext(args.model)
    with folder as model_dir:
        source = args.model
        if args.run:
            source = f"{args.run.run}:{export_run(args.run, Path(model_dir))}"
        lm = harness_lm(model_dir, args.batch_size, args.device, args.dtype)
        results = evaluate(lm, manager, tasks, limit, args.num_fewshot, args.log_samples, args.seed)
    results["moe_lm"] = {"model": source, "tasks": tasks, "start_token_id": lm.prefix_token_id}

    from lm_eval.utils import make_table

    print(make_table(results))
    for path in write_results(results, out):
        print(f"wrote {path}")


if __name__ == "__main__":
    run(main)
