"""The ablate_experts.py workflow, from checked flags to its files: the documents under the document budget, the
targets (given, or each domain's most loaded expert per layer), the study (ablation.py) and ablation.json,
ablation.png and ablation.md. `moe-lm ablate` (moe_lm/cli/ablate.py) parses the flags and calls `ablate_experts`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from moe_lm.analysis import metrics as M
from moe_lm.analysis import plots
from moe_lm.analysis.ablation import ablation_study
from moe_lm.analysis.budget import budget_document_count, print_sample_lines
from moe_lm.analysis.documents import document_stream
from moe_lm.analysis.recording import record_trace
from moe_lm.analysis.report_files import strict_json
from moe_lm.analysis.requests import AblationRequest
from moe_lm.analysis.subjects import kind_of, load_subject
from moe_lm.errors import UserError
from moe_lm.routing.routed_model import DocumentIds
from moe_lm.routing.torch_routing import TorchRouting

Target = tuple[int, list[int]]  # (MoE layer, experts routed around together)


def ablate_experts(req: AblationRequest) -> dict:
    """The ablation a request asks for (`moe-lm ablate` builds it from its flags, having checked them); writes
    ablation.json, ablation.png and ablation.md into `req.out` (created), prints the table and returns the result."""
    out = Path(req.out)
    out.mkdir(parents=True, exist_ok=True)
    if not kind_of(req.subject).reroutable:
        raise UserError(f"{req.subject.label}: a {req.subject.kind} subject cannot be routed around (ablate takes a "
                        "PyTorch model: a run or a transformers checkpoint)")  # fmt: skip
    subject = load_subject(req.subject)
    stream, domains, _ = document_stream(subject, req.documents)
    docs = list(stream)
    docs, samples = budget_document_count(docs, len(domains), req.max_documents)
    print(f"{len(docs)} documents of {len(domains)} domains (--max-documents {req.max_documents}, equal shares):")
    print_sample_lines(samples, domains, unit="documents")
    routing, seq_len = subject.routing.reroutable(), subject.seq_len
    if routing is None:  # a checkpoint larger than memory, streamed: nothing to route around
        raise UserError(f"{req.subject.label}: ablation runs the model whole, and it is streamed here (larger than "
                        "the memory given); give a --max-memory it fits in")  # fmt: skip
    check_targets(list(req.targets), routing.layers, routing.n_experts)
    targets = list(req.targets) or specialised_targets(routing, docs, domains, seq_len, out)
    print(f"routing around {len(targets)} targets with {req.controls} controls each, on {len(docs)} documents")
    result = ablation_study(routing, docs, domains, targets, seq_len, req.controls, req.n_boot)
    result["subject"] = subject.provenance
    result["sampling"] = {name: dataclasses.asdict(s) for name, s in zip(domains, samples, strict=True)}
    write_ablation(result, domains, out)
    print((out / "ablation.md").read_text())
    return result


def check_targets(targets: list[Target], layers: list[int], n_experts: int) -> None:
    """A user error naming the targets that are not (MoE layer, existing experts) of the model."""
    bad = [t for t in targets if t[0] not in layers or not all(0 <= e < n_experts for e in t[1])]
    if bad:
        raise UserError(f"targets {bad}: MoE layers are {layers}, experts 0..{n_experts - 1}")


def specialised_targets(routing: TorchRouting, docs: DocumentIds, domains, seq_len: int, out: Path) -> list[Target]:
    """In every MoE layer, the expert with the highest relative load on each domain (duplicates merged)."""
    trace = record_trace(routing, docs, out / "trace", domains, seq_len, progress=False)
    targets = []
    for layer in trace.layers:
        load = M.domain_shares(np.asarray(trace.experts(layer)), trace.domain, len(domains), trace.n_experts)
        for e in sorted({int(np.nanargmax(row)) for row in load["relative_load"]}):
            targets.append((layer, [e]))
    return targets


def ablation_table(result: dict, domains: list[str]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The figure's numbers: target names ("L{layer} e{experts}"), and [targets, domains] Δ loss of each target
    and the mean Δ loss of its controls."""
    names = [f"L{r['layer']} e{','.join(map(str, r['experts']))}" for r in result["ablations"]]
    delta = np.array([[r["by_domain"][d]["delta"] for d in domains] for r in result["ablations"]])
    control = np.array(
        [[np.mean([c["by_domain"][d]["delta"] for c in r["controls"]]) for d in domains] for r in result["ablations"]]
    )
    return names, delta, control


def write_ablation(result: dict, domains: list[str], out: Path) -> None:
    """ablation.json (the result), ablation.png (targets x domains, against controls) and ablation.md (the table)."""
    (out / "ablation.json").write_text(strict_json(result))
    names, delta, control = ablation_table(result, domains)
    plots.save(plots.ablation_heatmap(delta, control, names, domains), out / "ablation.png")
    (out / "ablation.md").write_text(markdown(result, names, domains))


def markdown(result: dict, names: list[str], domains: list[str]) -> str:
    """The Δ loss table per target and domain, with its interval and each control's Δ, under the base losses."""
    lines = [
        "| ablated | domain | Δ loss (95 % CI) | controls' Δ (each) |",
        "|---|---|---|---|",
    ]
    for name, r in zip(names, result["ablations"], strict=True):
        for d in domains:
            v = r["by_domain"][d]
            ctrl = ", ".join(f"{c['by_domain'][d]['delta']:+.4f}" for c in r["controls"])
            lines.append(f"| {name} | {d} | {v['delta']:+.4f} ({v['ci95'][0]:+.4f}, {v['ci95'][1]:+.4f}) | {ctrl} |")
    base = ", ".join(f"{d} {v:.3f}" for d, v in result["base_loss"].items())
    return f"Base loss (nats/token): {base}\n\n" + "\n".join(lines) + "\n"
