"""Decoding speed with MTP drafts against plain decoding, side by side, on a trained run.

    python launch/bench_decode.py --run runs/tiny_mtp                         # greedy, 8 prompts, 128 tokens each
    python launch/bench_decode.py --run runs/tiny_mtp --temperature 0.8 --top-p 0.95

Prompts are the first --prompt-tokens tokens of validation documents (one per document, in order). Each round
decodes every prompt plainly and speculatively (the order alternates between rounds), so a shared machine's noise
hits both alike. Reports tokens/s of each (median over rounds), their ratio, the draft acceptance rate per depth and
the tokens emitted per main-model pass; greedy outputs are checked to be identical.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from moe_lm.checkpoint.format import load_model, parse_run
from moe_lm.cli import fail, run
from moe_lm.data.prepare import load_split
from moe_lm.inference.generate import generate
from moe_lm.inference.sampling import Sampling
from moe_lm.inference.speculative import SpeculativeStats, speculative_generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=parse_run)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (decoding one sequence: 1 is fastest here)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    try:
        cfg, model, tag = load_model(*args.run)
        shard = load_split(cfg.data.out_dir, "val")
    except (FileNotFoundError, ValueError) as e:  # DataError is a ValueError
        fail(str(e))
    if not cfg.model.mtp.depth:
        fail(f"{args.run.run} has no MTP modules (train with model.mtp.depth=1 or more)")
    prompts = [
        np.asarray(shard.document(d))[: args.prompt_tokens].tolist()
        for d in range(shard.n_docs)
        if len(shard.document(d)) >= args.prompt_tokens
    ][: args.prompts]
    sampling = Sampling(args.temperature, 0, args.top_p)
    rates: dict[str, list[float]] = {"plain": [], "mtp": []}
    stats = SpeculativeStats(proposed=[0] * cfg.model.mtp.depth, accepted=[0] * cfg.model.mtp.depth)
    emitted = 0
    for r in range(args.rounds):
        order = ("plain", "mtp") if r % 2 == 0 else ("mtp", "plain")
        outputs = {}
        for kind in order:
            t0, n = time.perf_counter(), 0
            outputs[kind] = []
            for i, prompt in enumerate(prompts):
                if kind == "plain":
                    ids = generate(model, prompt, args.max_tokens, sampling, seed=i)
                else:
                    ids, s = speculative_generate(model, prompt, args.max_tokens, sampling, seed=i)
                    if r == 0:
                        stats.rounds += s.rounds
                        stats.proposed = [a + b for a, b in zip(stats.proposed, s.proposed, strict=True)]
                        stats.accepted = [a + b for a, b in zip(stats.accepted, s.accepted, strict=True)]
                        emitted += len(ids)
                outputs[kind].append(ids)
                n += len(ids)
            rates[kind].append(n / (time.perf_counter() - t0))
        if args.temperature <= 0 and outputs["plain"] != outputs["mtp"]:
            sys.exit("error: greedy speculative output differs from plain greedy output")
    plain, mtp = statistics.median(rates["plain"]), statistics.median(rates["mtp"])
    accept = ", ".join(f"depth {j} {100 * a:.1f} %" for j, a in enumerate(stats.acceptance(), start=1))
    print(
        f"{args.run.run}:{tag}, {len(prompts)} prompts of {args.prompt_tokens} tokens, {args.max_tokens} new tokens "
        f"each, temperature {args.temperature}, {torch.get_num_threads()} thread(s), {args.rounds} rounds"
    )
    print(f"plain {plain:,.1f} tokens/s | MTP speculative {mtp:,.1f} tokens/s | speed-up {mtp / plain:.2f}x")
    print(
        f"drafts accepted: {accept}; {emitted / max(stats.rounds, 1):.2f} tokens per main-model pass"
        + ("; greedy outputs identical" if args.temperature <= 0 else "")
    )


if __name__ == "__main__":
    run(main)
