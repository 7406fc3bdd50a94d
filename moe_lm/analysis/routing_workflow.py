"""The routing analysis, from checked flags to the report: the documents under the token budget, the traces (trained
model, untrained baseline N1, an optional compared checkpoint), the report's numbers and files, an optional wandb
log and the console summary. `moe-lm analyze` (moe_lm/cli/analyze.py) parses the flags and calls `analyze_routing`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from moe_lm.analysis.budget import budget_documents, print_sample_lines
from moe_lm.analysis.report import ReportRequest, build_report, figure_layers
from moe_lm.analysis.requests import RoutingRequest, SubjectRequest
from moe_lm.analysis.subject import Subject, load_subject, user_documents
from moe_lm.analysis.trace import Trace, record_trace
from moe_lm.checkpoint.format import RunRef, load_model
from moe_lm.data.documents import DataError
from moe_lm.data.prepare import load_split
from moe_lm.errors import UserError

Documents = list[tuple[int, np.ndarray]]  # (domain index, token ids) per document


def analyze_routing(req: RoutingRequest) -> dict:
    """The whole analysis a request asks for (`moe-lm analyze` builds it from its flags, having checked them);
    writes trace*/, figures/, routing.html, metrics.json and metrics.csv into `req.out` (created) and returns the
    metrics."""
    out = Path(req.out)
    out.mkdir(parents=True, exist_ok=True)
    subject = load_subject(req.subject)
    docs, domains, source = budgeted_documents(subject, req.subject, req.max_tokens)
    common = dict(seq_len=subject.seq_len, batch_size=req.batch_size)
    trace = record_trained(subject, docs, domains, source, out, common)
    init_trace = None if not req.init_baseline else record_untrained(subject, docs, domains, source, out, common)
    compare_trace, label = None, ""
    if req.compare:
        compare_trace, label = record_compared(req.compare, docs, domains, source, out, common)
    rows = training_metrics(subject.run)
    drawn = figure_layers(trace.layers, list(req.layers) if req.layers is not None else None)
    print(f"figures and preferred-token tables for MoE layers {drawn} (--layers to choose)")
    report = ReportRequest(trace, subject.tok, list(req.chart_tokens), init_trace, compare_trace, label, rows,
                           req.min_count, layers_to_draw=drawn)  # fmt: skip
    result = build_report(report, out)
    if req.wandb:
        log_to_wandb(subject, out, result)
    print_summary(result)
    return result


def budgeted_documents(subject: Subject, what: SubjectRequest, max_tokens: int) -> tuple[Documents, list[str], dict]:
    """The documents to analyse under --max-tokens (spread equally over the domains, reported on the console),
    the domain names, and the trace's `source` (where the documents came from and what each domain gave)."""
    stream, domains, source = document_stream(subject, what, max_tokens)
    try:
        docs, samples = budget_documents(stream, domains, max_tokens)
    except DataError as e:
        raise UserError(f"--data: {e}") from None
    if not docs:
        raise UserError(f"no tokens to analyse in {source['data']}")
    total = sum(s.tokens for s in samples)
    print(f"analysing {total:,} tokens of {len(domains)} domains (--max-tokens {max_tokens:,}, equal shares):")
    print_sample_lines(samples, domains)
    source["sampling"] = {name: dataclasses.asdict(s) for name, s in zip(domains, samples, strict=True)}
    return docs, domains, source


def document_stream(
    subject: Subject, what: SubjectRequest, max_tokens: int
) -> tuple[Iterable[tuple[int, np.ndarray]], list[str], dict]:
    """(domain index, token ids) of --data, or of the run's validation split, lazily; the domain names (for --data
    filled as the stream is read) and the `source` naming the documents."""
    if what.data:
        domains: list[str] = []
        stream = user_documents(list(what.data), subject.tok, domains, what.text_field, what.domain_field, max_tokens)
        return stream, domains, {"data": list(what.data)}
    shard = load_split(subject.cfg.data.out_dir, "val")
    stream = ((int(shard.doc_domain[d]), np.asarray(shard.document(d))) for d in range(shard.n_docs))
    return stream, list(shard.domains), {"data": f"{subject.cfg.data.out_dir} (validation split)"}


def record_trained(
    subject: Subject, docs: Documents, domains: list[str], source: dict, out: Path, common: dict
) -> Trace:
    """The trained model's trace into out/trace; the model is let go afterwards (`common`: seq_len, batch_size)."""
    trace = record_trace(
        subject.model, docs, out / "trace", domains, source={**source, **subject.source},
        progress="routing (trained model)", **common,
    )  # fmt: skip
    print(f"recorded {trace.n:,} tokens in {trace.meta['n_docs']} documents at {trace.meta['tokens_per_s']:,.0f} tok/s")
    subject.model = None  # why: the N1 twin is built next; one copy of a large model at a time
    return trace


def record_untrained(
    subject: Subject, docs: Documents, domains: list[str], source: dict, out: Path, common: dict
) -> Trace:
    """Baseline N1: the same tokens through the untrained model, into out/trace_init."""
    return record_trace(
        subject.untrained(), docs, out / "trace_init", domains, source={**source, "model": "initialisation"},
        progress="routing (untrained baseline N1)", **common,
    )  # fmt: skip


def record_compared(
    spec: RunRef, docs: Documents, domains: list[str], source: dict, out: Path, common: dict
) -> tuple[Trace, str]:
    """--compare RUN[:TAG]: that checkpoint's trace of the same tokens, into out/trace_compare, and its label."""
    crun, ctag = spec
    try:
        _, cmodel, ctag = load_model(crun, ctag)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"--compare: {e}") from None
    label = f"{crun}:{ctag}"
    trace = record_trace(
        cmodel, docs, out / "trace_compare", domains, source={**source, "run": label},
        progress=f"routing ({label})", **common,
    )  # fmt: skip
    return trace, label


def training_metrics(run: Path | None) -> list[dict] | None:
    """The rows of a moe-lm run's metrics.jsonl (for the load-over-training figure); None without one."""
    metrics_file = run / "metrics.jsonl" if run else None
    if not (metrics_file and metrics_file.is_file()):
        return None
    return [json.loads(line) for line in metrics_file.read_text().splitlines()]


def log_to_wandb(subject: Subject, out: Path, result: dict) -> None:
    """Attach figures and the per-domain shares to the run's own wandb run (offline runs sync later)."""
    if subject.run is None:
        print("warning: --wandb: only a moe-lm run has a wandb run to log to", file=sys.stderr)
        return
    from moe_lm.train.tracker import open_wandb  # why here: only --wandb needs the training side's tracker

    wandb = open_wandb(subject.cfg.logging, subject.run, create=False)
    if wandb is None:
        return
    data = {f"routing/{p.stem}": wandb.Image(str(p)) for p in sorted((out / "figures").glob("*.png"))}
    domains = result["trace"]["domains"]
    table = wandb.Table(columns=["layer", "domain", "expert", "token_share", "relative_load"])
    for layer, lm in result["layers"].items():
        for d, name in enumerate(domains):
            for e, share in enumerate(lm["domain_token_share"][d]):
                table.add_data(int(layer), name, e, share, lm["domain_relative_load"][d][e])
    data["routing/domain_shares"] = table
    wandb.log(data)
    wandb.finish()


def print_summary(result: dict) -> None:
    """One console line per MoE layer (the headline numbers next to their baselines)."""
    base = result["baseline_uniform_N0"]
    for layer, lm in result["layers"].items():
        r = lm["repetition"]
        print(
            f"layer {layer}: MaxVio_global {lm['maxvio_global']:.3f} (floor {base['maxvio_floor']:.3f}) | domain JSD "
            f"{lm['mean_domain_jsd_bits']:.4f} bits (token-shuffled "
            f"{lm['mean_domain_jsd_bits_token_shuffled_N2']:.4f}) | "
            f"same first choice {r['same_first']:.3f} (random {base['same_first']:.3f}) | top-k overlap "
            f"{r['topk_overlap']:.3f} (random {base['topk_overlap']:.3f})"
        )
