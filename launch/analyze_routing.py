"""Record which expert every token chose and draw the figures MoE papers report, with baselines.

    python launch/analyze_routing.py --run runs/tiny --out runs/tiny/analysis
    python launch/analyze_routing.py --run runs/tiny --data my_corpus/ --out analysis_mine --tokens . , the what
    python launch/analyze_routing.py --run runs/tiny --compare runs/tiny:step_00000250 --out analysis  # saturation
    python launch/analyze_routing.py --hf path/to/DeepSeek-V2-Lite --data corpus/ --out analysis_v2lite

--run: a moe-lm run (default data: its validation split, documents with their domains); --hf: a transformers MoE
checkpoint (DeepseekV3/V2, Glm4Moe, Qwen2Moe/Qwen3Moe, OlmoE, Mixtral) with its own tokenizer, in --dtype on
--device. --data takes .txt/.jsonl files or folders (a sub-folder per domain), tokenised with the subject's
tokenizer. Writes into --out: trace/ (the recorded routing, see moe_lm/analysis/trace.py), trace_init/ (the same
tokens through the untrained model: baseline N1, for --hf the architecture re-initialised), figures/*.png,
routing.html and metrics.json; with --wandb, logs the figures to the run's own wandb run too. The token budget
(--max-tokens) is spread equally over the domains (a domain with less text gives the rest to the others); the
console and metrics.json say what each domain contributed, and warn about a domain with less than its share.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from moe_lm.analysis.budget import budget_documents, sample_lines
from moe_lm.analysis.report import build_report, figure_layers
from moe_lm.analysis.subject import add_subject_args, open_subject, user_documents
from moe_lm.analysis.trace import record_trace
from moe_lm.checkpoint.format import load_model, parse_run
from moe_lm.cli import UserError, output_dir, run
from moe_lm.data.documents import DataError
from moe_lm.data.prepare import load_split
from moe_lm.train.tracker import open_wandb

DEFAULT_TOKENS = [".", ",", "the", "(", "def", "\n", "what"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_subject_args(ap)
    ap.add_argument("--out", required=True, help="output folder (created)")
    ap.add_argument(
        "--compare", type=parse_run, help="another checkpoint (RUN or RUN:TAG) routed on the same tokens: saturation"
    )
    ap.add_argument("--tokens", nargs="*", default=DEFAULT_TOKENS, help="tokens for per-token charts")
    ap.add_argument(
        "--max-tokens", type=int, default=200_000,
        help="token budget, spread equally over the domains (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--min-count", type=int, default=20, help="minimum occurrences for vocabulary specialisation")
    ap.add_argument("--no-init-baseline", action="store_true", help="skip the untrained-model baseline (N1)")
    ap.add_argument(
        "--layers",
        nargs="*",
        type=int,
        help="MoE layers to draw and tabulate (default: all up to 8 MoE layers, "
        "else the first, middle and last; the metrics cover every layer)",
    )
    ap.add_argument("--wandb", action="store_true", help="also log the figures to the run's own wandb run")
    args = ap.parse_args()
    if args.max_tokens < 1:
        ap.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    out = output_dir(args.out)
    subject = open_subject(ap, args)
    tok = subject.tok
    if args.data:
        domains: list[str] = []
        stream = user_documents(args.data, tok, domains, args.text_field, args.domain_field, args.max_tokens)
        source = {"data": args.data}
    else:
        shard = load_split(subject.cfg.data.out_dir, "val")
        domains = list(shard.domains)
        stream = ((int(shard.doc_domain[d]), np.asarray(shard.document(d))) for d in range(shard.n_docs))
        source = {"data": f"{subject.cfg.data.out_dir} (validation split)"}
    try:
        docs, samples = budget_documents(stream, domains, args.max_tokens)
    except DataError as e:
        raise UserError(f"--data: {e}") from None
    if not docs:
        raise UserError(f"no tokens to analyse in {source['data']}")
    total = sum(s.tokens for s in samples)
    print(f"analysing {total:,} tokens of {len(domains)} domains (--max-tokens {args.max_tokens:,}, equal shares):")
    for line in sample_lines(samples, domains):
        print(line, file=sys.stderr if line.startswith("warning") else sys.stdout)
    source["sampling"] = {name: dataclasses.asdict(s) for name, s in zip(domains, samples, strict=True)}
    common = dict(seq_len=subject.seq_len, batch_size=args.batch_size)
    trace = record_trace(
        subject.model, docs, out / "trace", domains, source={**source, **subject.source},
        progress="routing (trained model)", **common,
    )  # fmt: skip
    print(f"recorded {trace.n:,} tokens in {trace.meta['n_docs']} documents at {trace.meta['tokens_per_s']:,.0f} tok/s")
    subject.model = None  # why: the N1 twin is built next; one copy of a large model at a time
    init_trace = None
    if not args.no_init_baseline:
        init_trace = record_trace(
            subject.untrained(), docs, out / "trace_init", domains, source={**source, "model": "initialisation"},
            progress="routing (untrained baseline N1)", **common,
        )  # fmt: skip
    compare_trace, label = None, ""
    if args.compare:
        crun, ctag = args.compare
        try:
            _, cmodel, ctag = load_model(crun, ctag)
        except (FileNotFoundError, ValueError) as e:
            raise UserError(f"--compare: {e}") from None
        label = f"{crun}:{ctag}"
        compare_trace = record_trace(
            cmodel, docs, out / "trace_compare", domains, source={**source, "run": label},
            progress=f"routing ({label})", **common,
        )  # fmt: skip
    metrics_file = subject.run / "metrics.jsonl" if subject.run else None
    rows = (
        [json.loads(line) for line in metrics_file.read_text().splitlines()]
        if metrics_file and metrics_file.is_file()
        else None
    )
    drawn = figure_layers(trace.layers, args.layers)
    print(f"figures and preferred-token tables for MoE layers {drawn} (--layers to choose)")
    result = build_report(
        trace, out, tok, args.tokens, init_trace, compare_trace, label, rows, args.min_count, layers_to_draw=drawn
    )
    if args.wandb:
        if subject.run is None:
            print("warning: --wandb: only a moe-lm run has a wandb run to log to", file=sys.stderr)
        else:
            _log_wandb(subject.cfg, subject.run, out, result)
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
    print(
        f"wrote {out / 'metrics.json'}, {out / 'metrics.csv'}, {out / 'routing.html'} and "
        f"{len(list((out / 'figures').glob('*.png')))} figures"
    )


def _log_wandb(cfg, run: Path, out: Path, result: dict) -> None:
    """Attach figures and the per-domain shares to the run's own wandb run (offline runs sync later)."""
    wandb = open_wandb(cfg.logging, run, create=False)
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


if __name__ == "__main__":
    run(main)
