"""`moe-lm prune` from a checked request to the pruned model, in the source's own format: a moe-lm run pruned into a
run folder, readable wherever a run is (`--run` of analyze, evaluate, generate, export); a transformers folder, an FP8
release and a GGUF file pruned into a new one of the same format (formats.py).

    source (--run, --hf, --gguf) --> calibration trace (recorded as `moe-lm analyze` records one for that kind, or
        --trace) --> scores per layer (criteria.py) --> KeepPlan (plan.py; MTP / NextN layers the trace does not
        reach keep the last traced layer's ids) --> the format's writer, prune.json and the trace with it

The source is only read. The output, the plan's count and the criterion are checked before anything is loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from moe_lm.analysis.documents import Documents
from moe_lm.analysis.recording import record_trace
from moe_lm.analysis.requests import RoutingRequest
from moe_lm.analysis.routing_workflow import budgeted_documents
from moe_lm.analysis.subjects import RunSubject, SubjectKind, SubjectRequest, kind_of, load_subject
from moe_lm.analysis.subjects.run import run_config
from moe_lm.checkpoint.format import checkpoint_folder, data_reference, load_model
from moe_lm.checkpoint.weights_only import saved_dtype, write_weights
from moe_lm.config import Config
from moe_lm.errors import UserError
from moe_lm.flags import default_of
from moe_lm.model import Transformer, count_params
from moe_lm.output_folder import OutputFolder
from moe_lm.pruning.criteria import CRITERIA, FROM_TRACE, ablation_scores, check_domains, trace_documents, trace_scores
from moe_lm.pruning.formats import TRACE_FOLDER, FP8ReleaseFormat, GGUFFormat, PrunedFormat, SafetensorsFormat
from moe_lm.pruning.plan import PLAN_FILE, KeepPlan, RoutingShape, keep_count
from moe_lm.pruning.pruned import decoder_moe_layers, pruned_config, pruned_model
from moe_lm.routing.trace import Trace


@dataclasses.dataclass(frozen=True)
class PruneRequest:
    """`moe-lm prune`: keep `keep` experts of each MoE layer (or remove the fraction `sparsity`) by `criterion`,
    measured on the calibration documents of `domains` (None: all), and write the pruned `subject` to `out` in its
    own format (formats.py; `force`: a run folder's --force)."""

    subject: SubjectRequest
    out: Path  # the folder (a GGUF: the file) written; checked first, written whole beside it and renamed into place
    criterion: str = "reap"
    sparsity: float | None = None
    keep: int | None = None
    domains: tuple[str, ...] | None = None
    trace: Path | None = None  # a recorded trace to score from (else one is recorded from `documents`)
    documents: Documents = Documents()
    max_tokens: int = default_of(RoutingRequest, "max_tokens")
    batch_size: int = default_of(RoutingRequest, "batch_size")
    seed: int = 0
    force: bool = False
    ungroup: bool = False  # the pruned model routes without expert groups (plan.py): any count of at least top-k


def routing_shape(cfg: Config) -> RoutingShape:
    moe = cfg.model.moe
    return RoutingShape(moe.n_routed_experts, moe.n_group, moe.topk_group, moe.num_experts_per_tok)


def check_source(cfg: Config, label: str) -> None:
    """A UserError for a model `prune` cannot prune: another architecture than the decoder, or not causal."""
    if cfg.model.arch != "decoder" or cfg.model.attn_mask != "causal":
        raise UserError(f"{label}: prune takes the decoder-only, causal model (model.arch=decoder, "
                        f"model.attn_mask=causal), this is {cfg.model.arch}, {cfg.model.attn_mask}")  # fmt: skip


class RunFormat(PrunedFormat):
    """A moe-lm run's checkpoint pruned into a run folder (pruned.py: its MTP modules left out), which moe-lm prune
    replaces as its own output (--force moves another folder aside)."""

    format_name, what, flag = "run", "run", "--run"

    def __init__(self, request: RunSubject, source: Path) -> None:
        self.request, self.source = request, request.run.run
        self.checkpoint = checkpoint_folder(*request.run)
        cfg = run_config(request)
        check_source(cfg, request.label)
        self.shape = routing_shape(cfg)
        with torch.device("meta"):  # why: the MoE layer numbering as the model has it, nothing read but the config
            self.layers = decoder_moe_layers(Transformer(cfg.model))
        self.output: OutputFolder | None = None

    def about(self) -> dict:
        return {"run": str(self.source), "tag": self.checkpoint.name}

    def check_out(self, out: Path, force: bool) -> None:
        source, target = self.source.resolve(), Path(out).resolve()
        if target == source or target in source.parents:
            raise UserError(f"--out {out}: is the source run or holds it; prune never writes over its source, give "
                            "a new folder")  # fmt: skip
        self.output = OutputFolder(out, "prune", force=force)

    def write(self, plan: KeepPlan, out: Path, finish) -> None:
        needed = sum(p.stat().st_size for p in self.checkpoint.glob("*model_states.pt"))  # more than the pruned run's
        with self.output.staged(needed_bytes=needed) as folder:
            self.write_pruned(plan, folder, out)
            finish(folder, "")

    def write_pruned(self, plan: KeepPlan, folder: Path, final: Path) -> None:
        """The source loaded, pruned by `plan` and written as a run into `folder` (to end up at `final`)."""
        cfg, model, tag = load_model(self.source, self.checkpoint.name)
        pruned = pruned_model(model, cfg, plan)
        model = None
        new_cfg = pruned_config(cfg, plan)
        new_cfg = dataclasses.replace(new_cfg, train=dataclasses.replace(new_cfg.train, out_dir=str(final)))
        ref = self.checkpoint / "data_ref.json"
        data_ref = json.loads(ref.read_text()) if ref.is_file() else data_reference(cfg)
        write_weights(pruned, new_cfg, folder, tag, data_ref, saved_dtype(self.checkpoint))
        before, after = count_params(cfg.model).total, count_params(new_cfg.model).total
        self.params = f": {before / 1e6:.2f}M -> {after / 1e6:.2f}M parameters"

    def summary(self, plan: KeepPlan) -> str:
        return super().summary(plan) + getattr(self, "params", "")


FORMATS = {f.format_name: f for f in (RunFormat, SafetensorsFormat, FP8ReleaseFormat, GGUFFormat)}


def pruned_format(request: SubjectRequest) -> PrunedFormat:
    """The format a subject is pruned into, as its kind says (`SubjectKind.prune_source`), read without weights."""
    source = kind_of(request).prune_source(request)
    return FORMATS[source.format](request, source.path)


def prune(req: PruneRequest) -> KeepPlan:
    """The pruned model `req` asks for, written to `req.out` in the source's format; returns its plan."""
    fmt = pruned_format(req.subject)
    fmt.check_out(req.out, req.force)  # why first: a bad --out fails before any model is loaded
    shape = plan_shape(fmt.shape, req.ungroup, str(req.subject.label))
    n_keep = keep_count(shape, req.sparsity, req.keep)  # a count that cannot be kept fails at once
    trace = Trace(req.trace) if req.trace else None
    check_criterion(req, kind_of(req.subject), trace)
    if trace is not None:
        check_trace(trace, fmt, str(req.subject.label), f"--trace {req.trace}")
    with calibration_folder(req.out) as scratch:
        subject = load_subject(req.subject) if trace is None or req.criterion not in FROM_TRACE else None
        routing = held_whole(subject, req) if req.criterion == "ablation" else None  # why before recording
        if trace is None:
            trace = record_calibration(req, subject, scratch)
            check_trace(trace, fmt, str(req.subject.label), "the calibration trace")
        domains = list(req.domains) if req.domains else None
        if req.criterion in FROM_TRACE:
            scores = trace_scores(trace, req.criterion, domains, req.seed)
        else:
            docs = trace_documents(trace, domains)
            seq_len = trace.meta.get("windows") or subject.seq_len
            print(f"ablation: {len(routing.layers)} layers x {routing.n_experts} experts, each over {len(docs)} "
                  "documents")  # fmt: skip
            scores = ablation_scores(routing.forward, routing.routers, routing.n_experts, docs, seq_len,
                                     reroute=routing.reroute)  # fmt: skip
        subject = routing = None  # why: the writer may load the source again; one copy of a large model at a time
        about = {"criterion": req.criterion, "sparsity": 1 - n_keep / fmt.shape.n_experts, "domains": domains,
                 "source": fmt.about(), "calibration": calibration(trace, req, fmt), "seed": req.seed,
                 **ungrouped(fmt.shape, req.ungroup)}  # fmt: skip
        plan = KeepPlan.from_scores(scores, n_keep, shape.n_group, about).with_untraced(fmt.layers)

        def finish(folder: Path, prefix: str) -> None:
            (folder / f"{prefix}{PLAN_FILE}").write_text(json.dumps(plan.to_json(), indent=1) + "\n")
            if req.trace is None:
                shutil.move(trace.folder, folder / f"{prefix}{TRACE_FOLDER}")

        fmt.write(plan, req.out, finish)
    say_written(req, fmt, plan)
    return plan


def plan_shape(shape: RoutingShape, ungroup: bool, label: str) -> RoutingShape:
    """The routing a plan keeps valid: the source's, or one group with --ungroup (a UserError where it has none)."""
    if not ungroup:
        return shape
    if shape.n_group == 1:
        raise UserError(f"--ungroup: {label} routes without expert groups already (n_group 1); leave it out")
    return shape.ungrouped()


def ungrouped(shape: RoutingShape, ungroup: bool) -> dict:
    """prune.json's record of dropped groups: the source's, which the pruned model no longer has."""
    return {"ungrouped": {"n_group": shape.n_group, "topk_group": shape.topk_group}} if ungroup else {}


def held_whole(subject, req: PruneRequest):
    """The model ablation masks experts in: the subject's, held whole in memory; a UserError for one streamed."""
    routing = subject.routing.reroutable()
    if routing is None:
        others = [c for c in usable_criteria(kind_of(req.subject))
                  if c != "ablation" and NEEDS.get(c, set()) <= subject.routing.gives]  # fmt: skip
        raise UserError(f"--criterion ablation: {req.subject.label} is run a layer at a time (streamed from disk), "
                        "and ablation masks experts in a model held whole: give a --max-memory it fits in, or use "
                        f"{', '.join(others)}")  # fmt: skip
    return routing


def say_written(req: PruneRequest, fmt: PrunedFormat, plan: KeepPlan) -> None:
    print(fmt.summary(plan))
    for layer in plan.layers:
        print(f"  layer {layer}: removed {plan.removed(layer)}")
    if untraced := plan.about.get("untraced"):
        print(f"  layers {', '.join(untraced)} (MTP / NextN: no calibration token routes through them) keep the ids "
              f"of layer {next(iter(untraced.values()))}, the last traced one")  # fmt: skip
    if groups := plan.about.get("ungrouped"):
        print(f"  routes without expert groups (--ungroup; the source: {groups['n_group']} groups, the best "
              f"{groups['topk_group']} used)")  # fmt: skip
    print(f"wrote the pruned {fmt.what} {req.out} (read it as {fmt.flag} {req.out}; the plan: "
          f"{fmt.place(Path(req.out), PLAN_FILE)})")  # fmt: skip


NEEDS = {"gate-mass": {"weights"}, "reap": {"weights", "norms"}}  # the trace columns each criterion reads


def usable_criteria(kind: SubjectKind) -> list[str]:
    """The criteria a trace recorded from `kind` (and, for ablation, the model moe-lm runs of it) can score by."""
    return [c for c in CRITERIA if (kind.reroutable if c == "ablation" else NEEDS.get(c, set()) <= kind.gives)]


def check_criterion(req: PruneRequest, kind: SubjectKind, trace: Trace | None) -> None:
    """A UserError, before anything is loaded, for a criterion the subject's kind cannot give: the expert output
    norms REAP needs (recorded here or in --trace), a model moe-lm runs with experts masked (ablation)."""
    usable = usable_criteria(kind)
    if req.criterion == "ablation" and "ablation" not in usable:
        raise UserError(f"--criterion ablation masks experts in a model moe-lm runs in memory, and {kind.looks_like} "
                        f"is not one: use {', '.join(c for c in usable if c != 'ablation')}")  # fmt: skip
    held = trace is not None and NEEDS.get(req.criterion, set()) <= trace.columns  # else trace_scores names the trace
    if not held and req.criterion not in usable:
        what = "expert output norms" if req.criterion == "reap" else "gate weights"
        raise UserError(f"--criterion {req.criterion} needs the {what}, which a trace recorded from "
                        f"{kind.looks_like} does not hold yet: use {', '.join(usable)}")  # fmt: skip


@contextlib.contextmanager
def calibration_folder(out: Path) -> Iterator[Path]:
    """Where the calibration trace is recorded before the writer puts it with the pruned model: a hidden temporary
    folder beside `out` (the same disk, so that it is moved, not copied), removed at the end whatever happens."""
    anchor = next(p for p in Path(out).absolute().parents if p.is_dir())
    with tempfile.TemporaryDirectory(prefix=".moe-lm-prune-calibration-", dir=anchor) as scratch:
        yield Path(scratch) / TRACE_FOLDER


def record_calibration(req: PruneRequest, subject, folder: Path) -> Trace:
    """The calibration documents' routing, recorded into `folder` as `moe-lm analyze` records its trace (the same
    budget over domains, the same windows), with the experts' output norms where the subject gives them."""
    docs, domains, provenance = budgeted_documents(subject, req)
    check_domains(list(req.domains or ()), domains)  # why before recording: a misspelt domain fails at once
    trace = record_trace(subject.routing, docs, folder, domains, subject.seq_len, req.batch_size,
                         provenance={**provenance, **subject.provenance}, progress="calibration routing")  # fmt: skip
    print(f"recorded {trace.n:,} calibration tokens in {trace.meta['n_docs']} documents")
    return trace


def check_trace(trace: Trace, fmt: PrunedFormat, label: str, named: str) -> None:
    """A UserError for a trace that is not of this model's routing: its experts and top-k, and MoE layers that are
    the model's, every one of them but MTP / NextN layers after the last (which keep the last one's ids)."""
    shape = fmt.shape
    if (trace.n_experts, trace.k) != (shape.n_experts, shape.k):
        raise UserError(f"{named}: routed {trace.n_experts} experts, top-{trace.k}; {label} has {shape.n_experts}, "
                        f"top-{shape.k}: give a trace recorded from it")  # fmt: skip
    traced = sorted(trace.layers)
    untraced = [layer for layer in fmt.layers if layer not in traced]
    if not set(traced) <= set(fmt.layers) or (untraced and traced and untraced[0] < traced[-1]):
        raise UserError(f"{named}: its MoE layers {traced} are not {label}'s {fmt.layers}: give a trace recorded "
                        "from it")  # fmt: skip


def calibration(trace: Trace, req: PruneRequest, fmt: PrunedFormat) -> dict:
    """What the scores were measured on, for prune.json."""
    where = str(req.trace) if req.trace else fmt.place(Path(req.out), TRACE_FOLDER).name
    return {"trace": where, "tokens": trace.n, "documents": trace.meta["n_docs"], "domains": trace.domains,
            "data": trace.provenance.get("data")}  # fmt: skip
