"""Downstream evaluation of a Hugging Face export with EleutherAI's lm-evaluation-harness (the `eval` extra),
scoring exactly the ids training fed the model.

Every training document began with the tokenizer's document-start token (BOS, else EOS: `Tokenizer.doc_start_id`),
and export_hf writes that id as `bos_token_id` in config.json. lm-eval's `HFLM` scores a (context, continuation) pair
as `tokenizer(context + continuation)` split after `len(tokenizer(context))` tokens, and an empty context as
`[prefix_token_id] + continuation`. Whether `tokenizer(...)` adds BOS has changed between lm-eval versions (up to
0.4.8 a causal model got none unless `add_bos_token=True`; later the tokenizer's own default), so the model here is
built with `add_bos_token=True` and `prefix_token_id=<document start>`, and `check_start_token` verifies on the
built model that lm-eval's ids are `[start] + encode(text)` before anything is scored.

    manager, tasks = resolve_tasks(["hellaswag", "mmlu_stem", "my_tasks/qa.yaml"])
    lm = harness_lm("exports/tiny-hf", batch_size=8, device="cpu")
    results = evaluate(lm, manager, tasks, limit=100)
    results["results"]["hellaswag"]["acc,none"]
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

from moe_lm.checkpoint.format import RunRef
from moe_lm.errors import DataError, NotFound, UserError, install_hint


def document_start_id(export_dir: str | Path) -> int:
    """The token every training document began with, as export_hf wrote it (config.json's `bos_token_id`)."""
    config = Path(export_dir) / "config.json"
    if not config.is_file():
        raise NotFound(f"{config} not found: --model takes a folder written by `moe-lm export` (or give --run RUN)")
    start = json.loads(config.read_text()).get("bos_token_id")
    if start is None:
        raise DataError(
            f"{config} names no bos_token_id: the export has no tokenizer (exported with --config?); export a run "
            "with moe-lm export --run RUN, which writes its tokenizer and start token"
        )
    return int(start)


def harness_lm(export_dir: str | Path, batch_size: int | str = 1, device: str = "cpu", dtype: str = "auto"):
    """lm-eval's `HFLM` on an export, adding the document-start token as training did (checked)."""
    try:
        from lm_eval.models.huggingface import HFLM
    except ImportError as e:
        raise ImportError(f"evaluation needs lm-evaluation-harness: {install_hint('eval')} ({e})") from e

    start = document_start_id(export_dir)
    if not (Path(export_dir) / "tokenizer_config.json").is_file():
        raise NotFound(
            f"{export_dir} holds no Hugging Face tokenizer (tokenizer_config.json); re-export the run with "
            "moe-lm export --run RUN (its log says why a tokenizer was not converted)"
        )
    lm = HFLM(
        pretrained=str(export_dir),
        # why both: add_bos_token covers every context lm-eval tokenizes; prefix_token_id the empty context
        add_bos_token=True,
        prefix_token_id=start,
        batch_size=batch_size,
        device=device,
        dtype=dtype,
        trust_remote_code=False,  # lm-eval's default, said here: moe-lm never runs a folder's own code
    )
    check_start_token(lm, start, export_dir)
    return lm


# (context, continuation) pairs on which lm-eval's ids are checked: a plain one, a context with a leading space, one
# with a trailing space (lm-eval moves it into the continuation), and an empty context.
PROBE_PAIRS = [("The answer is", " yes"), (" leading space:", " 42"), ("Answer: ", "B"), ("", " alone")]


def check_start_token(lm, start: int, where: str | Path = "the export") -> None:
    """Raise unless the (context, continuation) ids lm-eval builds are `[start] + ids of context + continuation`,
    split after the context, and an empty context is `[start]`: the documents the model was trained on."""
    for context, continuation in PROBE_PAIRS:
        plain = lm.tok_encode(context + continuation, add_special_tokens=False)
        if context:
            ctx, cont = lm._encode_pair(context, continuation)
        else:  # why: loglikelihood() special-cases an empty context with prefix_token_id
            ctx, cont = [lm.prefix_token_id], lm.tok_encode(continuation, add_special_tokens=False)
        if ctx + cont != [start, *plain]:
            raise DataError(
                f"lm-eval would score {context + continuation!r} as {(ctx + cont)[:4]}..., not [{start}] + the text's "
                f"ids {plain[:3]}... (every training document began with token {start}): the tokenizer in {where} "
                "does not add it; re-export the run with moe-lm export --run RUN"
            )


def resolve_tasks(specs: list[str], include_path: str | Path | None = None):
    """(lm-eval's TaskManager, task names) for `specs`: registered names, glob patterns over them (e.g.
    `mmlu_high_school_*`), or task YAML files; `include_path` is a folder of the user's own task YAMLs. Checked
    before any model is loaded."""
    from lm_eval.tasks import TaskManager

    include = str(include_path) if include_path else None
    # why the user's own tasks first: indexing lm-eval's 14,683 task files takes ~15 s on every call, and tasks
    # given as YAML files or in --include-path need none of them unless they name one
    manager = TaskManager(include_path=include, include_defaults=False)
    if needs_lm_evals_tasks(specs, manager.task_index):
        manager = TaskManager(include_path=include)  # the include path's tasks override lm-eval's, as lm-eval does
    known, tasks = set(manager.all_tasks), []
    for spec in specs:
        if any(ch in spec for ch in "*?["):
            matched = sorted(fnmatch.filter(known, spec))
        else:
            matched = [spec] if spec in known or Path(spec).is_file() else []
        if not matched:
            raise UserError(
                f"--tasks {spec}: no such lm-eval task (`lm-eval ls tasks` lists them); give a task name, a glob "
                "pattern, a task YAML file, or --include-path FOLDER holding the YAML that defines it"
            )
        tasks += [t for t in matched if t not in tasks]
    return manager, tasks


def needs_lm_evals_tasks(specs: list[str], own: dict) -> bool:
    """Whether `specs` may reach a name that `own` (the index of the user's --include-path) lacks: a glob, a name not
    in it, a group (indexed there, or a YAML file) with such a member, or a YAML file this cannot read. Then
    lm-eval's own tasks are indexed too."""
    if any(ch in spec for spec in specs for ch in "*?["):
        return True
    try:
        todo = [_yaml_config(Path(s)) if Path(s).is_file() else s for s in specs]
    except (OSError, ValueError):  # why: lm-eval then names what is wrong with the file
        return True
    seen: set[str] = set()
    while todo:
        item = todo.pop()
        if isinstance(item, dict):  # a config: a group's members are names, or dicts naming a group or a task
            members = item.get("task") if "group" in item else []
            for m in members or []:
                todo += [m] if isinstance(m, str) else [m.get("group") or m.get("task"), m]
        elif not isinstance(item, str) or item not in own:
            return True  # why also a member dict's name: lm-eval takes a registered group before an inline one
        elif item not in seen:
            seen.add(item)
            todo.append(own[item].cfg or {})  # a tag has none: its members are tasks of `own`
    return False


def _yaml_config(path: Path) -> dict:
    """A task YAML's settings with its `include` chain resolved (its own keys win); lm-eval's `!function` tags read
    as nothing."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    cfg = yaml.load(path.read_text(), Loader=Loader)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a task config")
    if isinstance(cfg.get("include"), str):
        cfg = {**_yaml_config(path.parent / cfg["include"]), **cfg}
    return cfg


def evaluate(
    lm,
    manager,
    tasks: list[str],
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    log_samples: bool = False,
    seed: int = 0,
) -> dict:
    """lm-eval's `simple_evaluate` of `lm` on `tasks` (from `resolve_tasks`); returns lm-eval's results dict
    (`results`, `configs`, `versions`, `n-shot`, and `samples` with `log_samples`)."""
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        log_samples=log_samples,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )


@dataclass(frozen=True)
class EvalRequest:
    """`moe-lm eval`: lm-eval tasks on an export (`model_dir`) or on a run's checkpoint (`run`, a RunRef)."""

    tasks: tuple[str, ...]  # task names, globs or task YAML files
    model_dir: str | Path | None = None
    run: RunRef | None = None  # the checkpoint is exported with its tokenizer first
    include_path: str | None = None  # a folder of task YAMLs
    limit: int | float | None = None  # examples per task (a count, or a fraction below 1)
    num_fewshot: int | None = None
    batch_size: int | str = 1  # or "auto"
    device: str = "cpu"
    dtype: str = "auto"
    log_samples: bool = False
    seed: int = 0  # of few-shot sampling


def evaluate_export_or_run(req: EvalRequest, out: Path) -> tuple[dict, list[Path]]:
    """Evaluate the request's export, or its run's checkpoint exported with its tokenizer into a temporary folder
    under `out`; writes results.json (and samples) into `out`. Returns (results, files)."""
    import sys
    import tempfile
    from contextlib import nullcontext

    from moe_lm.interop.hf import export_run

    model_dir, run = req.model_dir, req.run
    if model_dir is not None:
        document_start_id(model_dir)  # why first: a folder that is no export is named before the task index is built
    manager, tasks = resolve_tasks(list(req.tasks), req.include_path)
    # why under out: a big model's export needs the room the user chose for results, not /tmp's
    folder = tempfile.TemporaryDirectory(dir=out, prefix=".export-") if run else nullcontext(model_dir)
    with folder as model_dir:
        source = str(model_dir)
        if run:
            tag, said = export_run(run.run, run.tag, Path(model_dir))  # why required: no evaluation without it
            print(f"exported {run.run}:{tag} with {said}", file=sys.stderr)
            source = f"{run.run}:{tag}"
        lm = harness_lm(model_dir, req.batch_size, req.device, req.dtype)
        results = evaluate(lm, manager, tasks, req.limit, req.num_fewshot, req.log_samples, req.seed)
    results["moe_lm"] = {"model": source, "tasks": tasks, "start_token_id": lm.prefix_token_id}
    return results, write_results(results, out)


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
