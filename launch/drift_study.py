"""How much quantisation changes which experts fire: a run exported as GGUF at each type, each file run in llama.cpp
on the run's validation split, compared token by token with the run itself (moe-lm, fp32) on the same ids.

    python launch/drift_study.py --run runs/tiny --out docs/results/drift/tiny
    python launch/drift_study.py --run runs/big --out docs/results/drift/big --types f16 q8_0 q4_K_M --max-tokens 20000

Writes into --out: summary.md (per type: what the file holds, the share of tokens whose experts differ in some
layer, per-layer flip rates with their intervals and chance, how many flips were near ties, the log-prob cost),
comparisons.json (every number, from `moe-lm analyze`'s metrics) and agreement.png. The same study on your own
GGUF files and their original is one command:

    moe-lm analyze --hf ORIGINAL --data DOCS --compare model-f16.gguf model-Q8_0.gguf model-Q4_K_M.gguf --out drift
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

TYPES = ("f32", "f16", "bf16", "q8_0", "q6_K", "q4_K_M", "q3_K_M", "q2_K")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a moe-lm run (its newest checkpoint)")
    ap.add_argument("--out", required=True, help="the study's folder (summary.md, comparisons.json, agreement.png)")
    ap.add_argument("--types", nargs="+", default=list(TYPES), help="GGUF types to export and compare")
    ap.add_argument("--max-tokens", type=int, default=60_000, help="validation tokens, equal shares per domain")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp's threads")
    args = ap.parse_args()

    from moe_lm.analysis.requests import RoutingRequest, SubjectRequest
    from moe_lm.analysis.routing_workflow import analyze_routing
    from moe_lm.checkpoint.format import parse_run
    from moe_lm.cli.main import main as moe_lm
    from moe_lm.interop.llama_cpp import tensor_types

    work = Path(tempfile.mkdtemp(prefix="drift_"))
    t0 = time.time()
    try:
        files = {}
        for kind in args.types:
            files[kind] = work / f"model-{kind}.gguf"
            moe_lm(["export", "--run", args.run, "--gguf", str(files[kind]), "--gguf-type", kind])
        compare = tuple(SubjectRequest(gguf=str(f), threads=args.threads) for f in files.values())
        request = RoutingRequest(SubjectRequest(run=parse_run(args.run)), out=work / "analysis",
                                 max_tokens=args.max_tokens, compare=compare, init_baseline=False)  # fmt: skip
        result = analyze_routing(request)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        comparisons = {kind: result["comparisons"][str(f)] for kind, f in files.items()}
        holds = {kind: tensor_types(f) for kind, f in files.items()}
        record = {"run": args.run, "trace": result["trace"], "files": holds, "comparisons": comparisons}
        (out / "comparisons.json").write_text(json.dumps(record, indent=1))
        shutil.copyfile(work / "analysis" / "figures" / "agreement.png", out / "agreement.png")
        (out / "summary.md").write_text(summary(args, result["trace"], comparisons, holds, time.time() - t0))
        print((out / "summary.md").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def summary(args, trace: dict, comparisons: dict, holds: dict, seconds: float) -> str:
    layers = [str(layer) for layer in trace["layers"]]
    lines = [
        f"# Routing drift under quantisation: {args.run}",
        "",
        f"{trace['tokens']:,} validation tokens ({trace['documents']} documents, {len(trace['domains'])} domains), "
        f"each file run in llama.cpp (f32 KV cache, flash attention off) against the run in moe-lm (fp32) on the "
        f"same token ids; intervals: 95 % over documents; chance: two independent routers with these frequencies. "
        f"`python launch/drift_study.py --run {args.run} --out {args.out}` ({seconds / 60:.0f} min).",
        "",
        "| file | tokens whose experts differ in some layer (chance) | flips per layer, % (95 % interval) | flips "
        "that were near ties (margin < 1e-4) | log-prob \\|Δ\\| mean / p99 / max | tensors |",
        "|---|---|---|---|---|---|",
    ]
    for kind, c in comparisons.items():
        any_layer, lp = c["tokens_differing_in_any_layer"], (c.get("logprob") or {}).get("all", {})
        flips = "; ".join(
            f"L{layer} {100 * c['layers'][layer]['flip_rate']['mean']:.2f} ("
            f"{100 * c['layers'][layer]['flip_rate']['interval'][0]:.2f}-"
            f"{100 * c['layers'][layer]['flip_rate']['interval'][1]:.2f})"
            for layer in layers
        )
        near = sum(c["layers"][layer]["flips_near_ties"] for layer in layers)
        total = sum(c["layers"][layer]["flips"] for layer in layers)
        lines.append(
            f"| {kind} | {100 * any_layer['mean']:.2f} % ({100 * any_layer['chance']:.1f} %) | {flips} | {near} of "
            f"{total} | {lp.get('mean_abs', float('nan')):.2e} / {lp.get('p99_abs', float('nan')):.2e} / "
            f"{lp.get('max_abs', float('nan')):.2e} | {holds[kind]} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
