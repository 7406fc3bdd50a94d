"""The routing analysis, from checked flags to the report: the documents under the token budget, the traces (the
subject, its untrained baseline N1, the compared subjects on the same token ids in the same windows), the report's
numbers and files, the console summary and, when asked, the run's wandb run. `moe-lm analyze` (moe_lm/cli/analyze.py)
parses the flags and calls `analyze_routing`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from moe_lm.analysis.budget import budget_documents, print_sample_lines
from moe_lm.analysis.documents import document_stream
from moe_lm.analysis.recording import record_trace
from moe_lm.analysis.report import ReportRequest, build_report, figure_layers
from moe_lm.analysis.requests import RoutingRequest
from moe_lm.analysis.subjects import Subject, SubjectRequest, TrainingRun, kind_of, load_subject, window_length_of
from moe_lm.analysis.wandb_log import log_to_wandb
from moe_lm.errors import ConfigError, DataError, UserError
from moe_lm.routing.routed_model import MAX_BATCH_LOGIT_BYTES, DocumentIds
from moe_lm.routing.trace import Trace


def analyze_routing(req: RoutingRequest) -> dict:
    """The whole analysis a request asks for (`moe-lm analyze` builds it from its flags, having checked them);
    writes trace*/, figures/, routing.html, metrics.json and metrics.csv into `req.out` (created) and returns the
    metrics."""
    out = Path(req.out)
    out.mkdir(parents=True, exist_ok=True)
    length = shared_window_length(req)
    subject = load_subject(for_analysis(req.subject, req, length))
    if req.layers:  # why before recording: a --layers that is no MoE layer would be refused after every layer ran
        figure_layers(list(subject.routing.layers), list(req.layers))
    docs, domains, provenance = budgeted_documents(subject, req)
    common = dict(seq_len=subject.seq_len, batch_size=batch_within_memory(req.batch_size, subject))
    shape = routing_shape(subject)
    trace = record_trained(subject, docs, domains, provenance, out, common)
    init_trace = None
    if req.init_baseline and subject.untrained is not None:
        init_trace = record_untrained(subject, docs, domains, provenance, out, common)
    elif req.init_baseline:
        print(f"no untrained baseline N1: {subject.no_untrained}")
    compared = tuple(
        record_compared(
            for_analysis(other, req, subject.seq_len),
            subject,
            shape,
            docs,
            domains,
            provenance,
            out / f"trace_compare_{i}",
            common,
        )  # fmt: skip
        for i, other in enumerate(req.compare)
    )
    rows = training_metrics(subject.run)
    drawn = figure_layers(trace.layers, list(req.layers) if req.layers is not None else None)
    print(f"figures and preferred-token tables for MoE layers {drawn} (--layers to choose)")
    left_out = subject.no_untrained if init_trace is None else ""
    report = ReportRequest(trace, subject.tok, list(req.chart_tokens), init_trace=init_trace, compared=compared,
                           no_untrained=left_out, metrics_rows=rows, min_count=req.min_count,
                           layers_to_draw=drawn)  # fmt: skip
    result = build_report(report, out)
    print_summary(result)
    if req.wandb:
        log_to_wandb(subject.run, out, result)
    return result


def for_analysis(what: SubjectRequest, req: RoutingRequest, length: int) -> SubjectRequest:
    """A subject's request as this analysis runs it: cut into windows of `length` tokens, with the analysis's work
    folder and the last MoE layer it draws (`SubjectKind.for_analysis`: what a subject streamed from disk uses)."""
    last = max(req.layers) if req.layers else None
    return kind_of(what).for_analysis(dataclasses.replace(what, seq_len=length), req.work, last)


def shared_window_length(req: RoutingRequest) -> int:
    """The window length every subject is cut into: --seq-len or the subject's own (a run's train.seq_len), capped
    by the context of the subject and of every compared subject, so that all of them route the same tokens with the
    same context (windows of other lengths give other routing: a run trained at 2,048 tokens against its own f32
    GGUF at 1,024 flipped 5.9 % of tokens). A cap is said in one line."""
    wanted, _ = window_length_of(req.subject)
    length, why = wanted, ""
    for what in (req.subject, *req.compare):
        _, context = window_length_of(what)
        if context is not None and context < length:
            length, why = context, f"{what.label}'s context is {context:,} tokens"
    if length < wanted:
        print(f"windows of {length:,} tokens for every subject, not {wanted:,}: {why}")
    return length


def batch_within_memory(batch_size: int, subject: Subject) -> int:
    """--batch-size, or fewer windows where the subject's routing would hold more than MAX_BATCH_LOGIT_BYTES of
    logits at once (said; `RoutedModel.windows_per_pass`: a model run whole cuts its batches, one streamed from disk
    makes its log-probs a few windows at a time and keeps them)."""
    bounded = subject.routing.windows_per_pass(batch_size, subject.seq_len, subject.vocab_size)
    if bounded < batch_size:
        print(
            f"--batch-size {batch_size}: {bounded} windows per forward pass (the logits of {subject.seq_len:,} "
            f"tokens x {subject.vocab_size:,} ids per window, within {MAX_BATCH_LOGIT_BYTES / 2**30:.0f} GiB)"
        )
    return bounded


def budgeted_documents(subject: Subject, req: RoutingRequest) -> tuple[DocumentIds, list[str], dict]:
    """The documents to analyse under --max-tokens (spread equally over the domains, reported on the console),
    the domain names, and the traces' provenance (where the documents came from and what each domain gave)."""
    max_tokens = req.max_tokens
    stream, domains, data = document_stream(subject, req.documents, max_tokens)
    try:
        docs, samples = budget_documents(stream, domains, max_tokens)
    except DataError as e:
        raise UserError(f"data: {e}") from None
    if not docs:
        raise UserError(f"no tokens to analyse in {data}")
    if left_out := [name for name, s in zip(domains, samples, strict=True) if s.tokens == 0]:
        raise UserError(
            f"--max-tokens {max_tokens:,} leaves {len(left_out)} of the {len(domains)} domains without a token (equal "
            f"shares; {left_out[0]!r} first): per-domain statistics need tokens in every domain; give --max-tokens of "
            f"at least {100 * len(domains):,} (100 per domain)"
        )
    total = sum(s.tokens for s in samples)
    print(f"analysing {total:,} tokens of {len(domains)} domains (--max-tokens {max_tokens:,}, equal shares):")
    print_sample_lines(samples, domains)
    sampling = {name: dataclasses.asdict(s) for name, s in zip(domains, samples, strict=True)}
    return docs, domains, {"data": data, "sampling": sampling}


def record_trained(
    subject: Subject, docs: DocumentIds, domains: list[str], provenance: dict, out: Path, common: dict
) -> Trace:
    """The trained model's trace into out/trace; the model is let go afterwards (`common`: seq_len, batch_size)."""
    trace = record_trace(
        subject.routing, docs, out / "trace", domains, provenance={**provenance, **subject.provenance},
        progress="routing (trained model)", **common,
    )  # fmt: skip
    print(f"recorded {trace.n:,} tokens in {trace.meta['n_docs']} documents at {trace.meta['tokens_per_s']:,.0f} tok/s")
    subject.routing = None  # why: the N1 twin is built next; one copy of a large model at a time
    return trace


def record_untrained(
    subject: Subject, docs: DocumentIds, domains: list[str], provenance: dict, out: Path, common: dict
) -> Trace:
    """Baseline N1: the same tokens through the untrained model, into out/trace_init."""
    return record_trace(
        subject.untrained(), docs, out / "trace_init", domains, provenance={**provenance, "model": "initialisation"},
        progress="routing (untrained baseline N1)", **common,
    )  # fmt: skip


def first_other_token(subject: Subject, other: Subject, docs: DocumentIds) -> tuple[int, bytes, bytes] | None:
    """The first id the documents use that stands for other bytes to `other` than to `subject` (with both), or None.
    why every id used and not a probe sentence: two vocabularies that swap two pieces cut a probe into the same ids
    unless it holds one of them, yet mean other words wherever the documents do."""
    used = np.unique(np.concatenate([ids for _, ids in docs])) if docs else []
    for i in used.tolist():
        ours, theirs = subject.tok.token_bytes(i), other.tok.token_bytes(i)
        if ours != theirs:
            return i, ours, theirs
    return None


def routing_shape(subject: Subject) -> tuple[list[int], int, int]:
    """(MoE layer ids, experts, experts per token) of a subject."""
    return list(subject.routing.layers), subject.routing.n_experts, subject.routing.k


def record_compared(
    what: SubjectRequest,
    subject: Subject,
    shape: tuple,
    docs: DocumentIds,
    domains: list[str],
    provenance: dict,
    out: Path,
    common: dict,
) -> tuple[str, Trace]:
    """Another subject's trace of the same token ids into `out`, with its label; refused in one line when its
    vocabulary (its size, or what any id the documents use stands for) or its MoE layers differ from the subject's."""
    label = what.label
    try:
        other = load_subject(what)
    except (UserError, DataError, ConfigError) as e:  # the project's errors only: anything else is a bug
        raise UserError(f"compared subject {label}: {e}") from None
    if other.vocab_size != subject.vocab_size:
        raise UserError(f"compared subject {label}: another vocabulary ({other.vocab_size:,} ids, the subject's "
                        f"{subject.vocab_size:,}); subjects are compared on the same token ids")  # fmt: skip
    if (differs := first_other_token(subject, other, docs)) is not None:
        i, ours, theirs = differs
        raise UserError(
            f"compared subject {label}: another vocabulary (token id {i} stands for {ours!r} to the subject and "
            f"{theirs!r} to it, the first id of the documents that differs); subjects are compared on the same ids"
        )
    if routing_shape(other) != shape:
        layers, E, K = routing_shape(other)
        raise UserError(
            f"compared subject {label}: MoE layers {layers} of {E} experts (top-{K}), the subject's {shape[0]} of "
            f"{shape[1]} (top-{shape[2]}): not the same architecture"
        )
    if other.seq_len != subject.seq_len:  # shared_window_length keeps it from happening: never compare other windows
        raise UserError(f"compared subject {label} takes windows of at most {other.seq_len:,} tokens, the subject was "
                        f"cut into {subject.seq_len:,}: give --seq-len {other.seq_len}")  # fmt: skip
    trace = record_trace(
        other.routing, docs, out, domains, provenance={**provenance, **other.provenance}, progress=f"routing ({label})",
        **common,
    )  # fmt: skip
    return label, trace


def training_metrics(run: TrainingRun | None) -> list[dict] | None:
    """The rows of a moe-lm run's metrics.jsonl (for the load-over-training figure); None without one."""
    metrics_file = run.folder / "metrics.jsonl" if run else None
    if not (metrics_file and metrics_file.is_file()):
        return None
    return [json.loads(line) for line in metrics_file.read_text().splitlines()]


def print_summary(result: dict) -> None:
    """One console line per MoE layer (the headline numbers next to their baselines), and one per compared
    subject."""
    base = result["baseline_uniform_N0"]
    for layer, lm in result["layers"].items():
        r = lm["repetition"]
        first = ("" if r["same_first"] is None  # experts recorded as sets: no first choice
                 else f"same first choice {r['same_first']:.3f} (random {base['same_first']:.3f}) | ")  # fmt: skip
        print(
            f"layer {layer}: MaxVio_global {lm['maxvio_global']:.3f} (floor {base['maxvio_floor']:.3f}) | domain JSD "
            f"{lm['mean_domain_jsd_bits']:.4f} bits (token-shuffled "
            f"{lm['mean_domain_jsd_bits_token_shuffled_N2']:.4f}) | {first}top-k overlap "
            f"{r['topk_overlap']:.3f} (random {base['topk_overlap']:.3f})"
        )
    for label, c in (result.get("comparisons") or {}).items():
        any_layer, cost = c["tokens_differing_in_any_layer"], (c.get("logprob") or {}).get("all", {})
        flips = ", ".join(f"L{layer} {100 * m['flip_rate']['mean']:.2f} %" for layer, m in c["layers"].items())
        lp = f" | log-prob |Δ| mean {cost['mean_abs']:.2e}, max {cost['max_abs']:.2e}" if cost.get("tokens") else ""
        print(f"vs {label}: experts differ for {100 * any_layer['mean']:.2f} % of tokens in some layer (chance "
              f"{100 * any_layer['chance']:.1f} %) | flips {flips}{lp}")  # fmt: skip
