"""Causal expert ablation: does an expert that specialises in a domain matter for that domain?

    python launch/ablate_experts.py --run runs/tiny --out runs/tiny/ablation
    python launch/ablate_experts.py --run runs/tiny --targets 3:5 3:1,2 --controls 5 --out ablation
    python launch/ablate_experts.py --run runs/tiny --data my_corpus/ --out ablation_mine
    python launch/ablate_experts.py --hf path/to/DeepSeek-V2-Lite --data mmlu.parquet --domain-field subject --out abl

For each target (LAYER:EXPERT[,EXPERT...]; default: in every MoE layer, the expert with the highest relative load
on each domain), the model routes around it (tokens take their next choice) and the per-domain loss change is
reported with a 95 % bootstrap interval over documents, next to --controls random same-size sets of experts of the
same layer. --max-documents is spread equally over the domains (a domain with fewer documents gives the rest to the
others). Works on moe-lm runs and on transformers MoE checkpoints (--hf, the architectures analyze_routing.py
takes). Writes ablation.json, ablation.md and ablation.png into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from moe_lm.analysis import metrics as M
from moe_lm.analysis import plots
from moe_lm.analysis.ablation import ablation_study
from moe_lm.analysis.budget import budget_document_count, sample_lines
from moe_lm.analysis.subject import add_subject_args, open_subject, user_documents
from moe_lm.analysis.trace import record_trace
from moe_lm.cli import UserError, output_dir, run
from moe_lm.data.prepare import load_split


def parse_target(spec: str) -> tuple[int, list[int]]:
    layer, _, experts = spec.partition(":")
    try:
        return int(layer), sorted({int(e) for e in experts.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAYER:EXPERT[,EXPERT...], got {spec!r}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_subject_args(ap)
    ap.add_argument("--out", required=True, help="output folder (created)")
    ap.add_argument("--targets", nargs="*", type=parse_target, help="LAYER:EXPERT[,EXPERT...] to route around")
    ap.add_argument("--controls", type=int, default=3, help="random same-size expert sets per target")
    ap.add_argument(
        "--max-documents", type=int, default=400,
        help="documents to evaluate, spread equally over the domains (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples (default: %(default)s)")
    args = ap.parse_args()
    if args.max_documents < 1:
        ap.error(f"--max-documents must be at least 1, got {args.max_documents}")
    out = output_dir(args.out)
    subject = open_subject(ap, args)
    docs, domains = documents(subject, args)
    docs, samples = budget_document_count(docs, len(domains), args.max_documents)
    print(f"{len(docs)} documents of {len(domains)} domains (--max-documents {args.max_documents}, equal shares):")
    for line in sample_lines(samples, domains, unit="documents"):
        print(line, file=sys.stderr if line.startswith("warning") else sys.stdout)
    model, seq_len = subject.model, subject.seq_len
    layers, E = model.moe_layer_ids(), model.cfg.moe.n_routed_experts
    bad = [t for t in args.targets or [] if t[0] not in layers or not all(0 <= e < E for e in t[1])]
    if bad:
        raise UserError(f"--targets {bad}: MoE layers are {layers}, experts 0..{E - 1}")
    targets = args.targets or specialised_targets(model, docs, domains, seq_len, out)
    print(f"routing around {len(targets)} targets with {args.controls} controls each, on {len(docs)} documents")
    result = ablation_study(model, docs, domains, targets, seq_len, args.controls, args.n_boot)
    result["subject"] = subject.source
    result["sampling"] = {name: dataclasses.asdict(s) for name, s in zip(domains, samples, strict=True)}
    (out / "ablation.json").write_text(json.dumps(result, indent=1))
    names = [f"L{r['layer']} e{','.join(map(str, r['experts']))}" for r in result["ablations"]]
    delta = np.array([[r["by_domain"][d]["delta"] for d in domains] for r in result["ablations"]])
    control = np.array(
        [[np.mean([c["by_domain"][d]["delta"] for c in r["controls"]]) for d in domains] for r in result["ablations"]]
    )
    plots.save(plots.ablation_heatmap(delta, control, names, domains), out / "ablation.png")
    (out / "ablation.md").write_text(markdown(result, names, domains))
    print((out / "ablation.md").read_text())


def documents(subject, args):
    """(domain index, token ids) per document, and the domain names: --data, or the run's validation split."""
    if not args.data:
        shard = load_split(subject.cfg.data.out_dir, "val")
        return [(int(shard.doc_domain[d]), np.asarray(shard.document(d))) for d in range(shard.n_docs)], shard.domains
    domains: list[str] = []
    docs = list(user_documents(args.data, subject.tok, domains, args.text_field, args.domain_field))
    return docs, domains


def specialised_targets(model, docs, domains, seq_len: int, out: Path) -> list[tuple[int, list[int]]]:
    """In every MoE layer, the expert with the highest relative load on each domain (duplicates merged)."""
    trace = record_trace(model, docs, out / "trace", domains, seq_len, progress=False)
    targets = []
    for layer in trace.layers:
        load = M.domain_shares(np.asarray(trace.experts(layer)), trace.domain, len(domains), trace.n_experts)
        for e in sorted({int(np.nanargmax(row)) for row in load["relative_load"]}):
            targets.append((layer, [e]))
    return targets


def markdown(result: dict, names: list[str], domains: list[str]) -> str:
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


if __name__ == "__main__":
    run(main)
