"""`moe-lm prune` from a checked request to its folder: a moe-lm run of the source's model with only the kept routed
experts, readable wherever a run is (`--run` of analyze, evaluate, generate, export).

    source run --> calibration trace (recorded as `moe-lm analyze` records one, or --trace) --> scores per layer
        (criteria.py) --> KeepPlan (plan.py) --> pruned model (pruned.py) --> <out>/checkpoints/<the source's tag>/
        (moe_lm/checkpoint/weights_only.py), <out>/prune.json, <out>/calibration_trace/ (when recorded here)

The source is only read. The plan's count is checked against the routing before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from moe_lm.analysis.documents import Documents
from moe_lm.analysis.recording import record_trace
from moe_lm.analysis.requests import RoutingRequest
from moe_lm.analysis.routing_workflow import budgeted_documents
from moe_lm.analysis.subjects import RunSubject, load_subject
from moe_lm.analysis.subjects.run import run_config
from moe_lm.checkpoint.format import checkpoint_folder, data_reference, load_model
from moe_lm.checkpoint.weights_only import saved_dtype, write_weights
from moe_lm.config import Config
from moe_lm.errors import UserError
from moe_lm.flags import default_of
from moe_lm.model import count_params
from moe_lm.pruning.criteria import FROM_TRACE, ablation_scores, check_domains, trace_documents, trace_scores
from moe_lm.pruning.plan import PLAN_FILE, KeepPlan, RoutingShape, keep_count
from moe_lm.pruning.pruned import pruned_config, pruned_model
from moe_lm.routing.trace import Trace

TRACE_FOLDER = "calibration_trace"


@dataclasses.dataclass(frozen=True)
class PruneRequest:
    """`moe-lm prune`: keep `keep` experts of each MoE layer (or remove the fraction `sparsity`) by `criterion`,
    measured on the calibration documents of `domains` (None: all), and write the pruned run into `out`."""

    subject: RunSubject
    out: Path  # the folder written (moe-lm prune: the staging folder)
    criterion: str = "reap"
    sparsity: float | None = None
    keep: int | None = None
    domains: tuple[str, ...] | None = None
    trace: Path | None = None  # a recorded trace to score from (else one is recorded from `documents`)
    documents: Documents = Documents()
    max_tokens: int = default_of(RoutingRequest, "max_tokens")
    batch_size: int = default_of(RoutingRequest, "batch_size")
    seed: int = 0
    final: Path | None = None  # where `out` ends up (the pruned config's train.out_dir); None: `out`


def routing_shape(cfg: Config) -> RoutingShape:
    moe = cfg.model.moe
    return RoutingShape(moe.n_routed_experts, moe.n_group, moe.topk_group, moe.num_experts_per_tok)


def check_source(cfg: Config, label: str) -> None:
    """A UserError for a model `prune` cannot prune: another architecture than the decoder, or not causal."""
    if cfg.model.arch != "decoder" or cfg.model.attn_mask != "causal":
        raise UserError(f"{label}: prune takes the decoder-only, causal model (model.arch=decoder, "
                        f"model.attn_mask=causal), this is {cfg.model.arch}, {cfg.model.attn_mask}")  # fmt: skip


def prune_run(req: PruneRequest) -> KeepPlan:
    """The pruned run `req` asks for, written into `req.out` (created); returns its plan."""
    out = Path(req.out)
    cfg = run_config(req.subject)
    check_source(cfg, req.subject.label)
    shape = routing_shape(cfg)
    n_keep = keep_count(shape, req.sparsity, req.keep)  # why first: a count that cannot be kept fails at once
    trace = Trace(req.trace) if req.trace else None
    if trace is not None:
        check_trace(trace, shape, req)
    subject = load_subject(req.subject) if trace is None or req.criterion not in FROM_TRACE else None
    if trace is None:
        trace = record_calibration(req, subject, out / TRACE_FOLDER)
    domains = list(req.domains) if req.domains else None
    if req.criterion in FROM_TRACE:
        scores = trace_scores(trace, req.criterion, domains, req.seed)
    else:
        docs = trace_documents(trace, domains)
        routing = subject.routing.reroutable()
        seq_len = trace.meta.get("windows") or subject.seq_len
        print(f"ablation: {len(routing.layers)} layers x {routing.n_experts} experts, each over {len(docs)} documents")
        scores = ablation_scores(routing.forward, routing.routers, routing.n_experts, docs, seq_len)
    subject = None  # why: the source is loaded again whole below; one copy of a large model at a time
    about = {"criterion": req.criterion, "sparsity": 1 - n_keep / shape.n_experts, "domains": domains,
             "source": {"run": str(req.subject.run.run), "tag": None}, "calibration": calibration(trace, req),
             "seed": req.seed}  # fmt: skip
    plan = KeepPlan.from_scores(scores, n_keep, shape.n_group, about)
    write_pruned(req, plan, out)
    return plan


def record_calibration(req: PruneRequest, subject, folder: Path) -> Trace:
    """The calibration documents' routing, recorded into `folder` as `moe-lm analyze` records its trace (the same
    budget over domains, the same windows), with the experts' output norms."""
    docs, domains, provenance = budgeted_documents(subject, req)
    check_domains(list(req.domains or ()), domains)  # why before recording: a misspelt domain fails at once
    trace = record_trace(subject.routing, docs, folder, domains, subject.seq_len, req.batch_size,
                         provenance={**provenance, **subject.provenance}, progress="calibration routing")  # fmt: skip
    print(f"recorded {trace.n:,} calibration tokens in {trace.meta['n_docs']} documents")
    return trace


def check_trace(trace: Trace, shape: RoutingShape, req: PruneRequest) -> None:
    """A UserError for a --trace that is not of this model's routing (its MoE layers, experts and top-k)."""
    with_model = (trace.n_experts, trace.k) == (shape.n_experts, shape.k)
    if not with_model:
        raise UserError(f"--trace {req.trace}: routed {trace.n_experts} experts, top-{trace.k}; {req.subject.label} "
                        f"has {shape.n_experts}, top-{shape.k}: give a trace recorded from it")  # fmt: skip


def calibration(trace: Trace, req: PruneRequest) -> dict:
    """What the scores were measured on, for prune.json."""
    return {"trace": str(req.trace) if req.trace else TRACE_FOLDER, "tokens": trace.n,
            "documents": trace.meta["n_docs"], "domains": trace.domains,
            "data": trace.provenance.get("data")}  # fmt: skip


def write_pruned(req: PruneRequest, plan: KeepPlan, out: Path) -> None:
    """The source loaded, pruned by `plan` and written as a run into `out`, with prune.json; said on the console."""
    run, tag = req.subject.run
    source = checkpoint_folder(run, tag)
    cfg, model, tag = load_model(run, source.name)
    if plan.layers != sorted(i for i in model.moe_layer_ids() if i < cfg.model.n_layers):
        raise UserError(f"the calibration trace's MoE layers {plan.layers} are not {req.subject.label}'s: give a trace "
                        "recorded from it")  # fmt: skip
    plan.about["source"]["tag"] = tag
    pruned = pruned_model(model, cfg, plan)
    model = None
    new_cfg = pruned_config(cfg, plan)
    new_cfg = dataclasses.replace(new_cfg, train=dataclasses.replace(new_cfg.train, out_dir=str(req.final or out)))
    ref = source / "data_ref.json"
    data_ref = json.loads(ref.read_text()) if ref.is_file() else data_reference(cfg)
    write_weights(pruned, new_cfg, out, tag, data_ref, saved_dtype(source))
    (out / PLAN_FILE).write_text(json.dumps(plan.to_json(), indent=1) + "\n")
    before, after = count_params(cfg.model).total, count_params(new_cfg.model).total
    print(f"kept {plan.n_keep} of {plan.n_experts} routed experts in each of {len(plan.layers)} MoE layers "
          f"({req.criterion}): {before / 1e6:.2f}M -> {after / 1e6:.2f}M parameters")  # fmt: skip
    for layer in plan.layers:
        print(f"  layer {layer}: removed {plan.removed(layer)}")
