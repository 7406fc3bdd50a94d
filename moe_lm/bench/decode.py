"""Decoding speed with MTP drafts against plain decoding, side by side, on a trained run.

    python -m moe_lm.bench decode --run runs/tiny_mtp                     # greedy, 8 prompts, 128 tokens each
    python -m moe_lm.bench decode --run runs/tiny_mtp --temperature 0.8 --top-p 0.95

Prompts are the first --prompt-tokens tokens of validation documents (one per document, in order). Each round
decodes every prompt plainly and speculatively (the order alternates between rounds), so a shared machine's noise
hits both alike. Reports tokens/s of each (median over rounds), their ratio, the draft acceptance rate per depth and
the tokens emitted per main-model pass; greedy outputs are checked to be identical.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from moe_lm.bench.timing import Measurement, interleave, summarize
from moe_lm.checkpoint.format import load_model, parse_run
from moe_lm.data.prepare import load_split
from moe_lm.errors import UserError
from moe_lm.inference.generate import generate
from moe_lm.inference.sampling import Sampling
from moe_lm.inference.speculative import SpeculativeStats, speculative_generate


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--run", type=parse_run, required=True, metavar="RUN[:TAG]",
                    help="a run trained with model.mtp.depth >= 1 (RUN:TAG for a given checkpoint)")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=8, help="prompts (validation documents, in order)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both decoders over all prompts")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (decoding one sequence: 1 is fastest here)")


class Decoders:
    """Both decoders over the same prompts; keeps the last outputs of each (to compare) and the speculative
    statistics of its first pass (later passes repeat the same work)."""

    def __init__(self, model, prompts: list[list[int]], max_tokens: int, sampling: Sampling, depth: int) -> None:
        self.model, self.prompts, self.max_tokens, self.sampling = model, prompts, max_tokens, sampling
        self.outputs: dict[str, list[list[int]]] = {}
        self.stats = SpeculativeStats(proposed=[0] * depth, accepted=[0] * depth)
        self.emitted = 0  # tokens of the first speculative pass
        self._counted = False

    def measure(self, kind: str) -> Measurement:
        """Tokens/s of one pass of `kind` ("plain" or "mtp") over every prompt."""

        def one_pass() -> dict[str, float]:
            t0 = time.perf_counter()
            results = [self._decode(kind, prompt, seed) for seed, prompt in enumerate(self.prompts)]
            rate = sum(len(ids) for ids, _ in results) / (time.perf_counter() - t0)
            self.outputs[kind] = [ids for ids, _ in results]
            if kind == "mtp" and not self._counted:
                self._count(results)
            return {"tokens/s": rate}

        return one_pass

    def _decode(self, kind: str, prompt: list[int], seed: int) -> tuple[list[int], SpeculativeStats | None]:
        if kind == "plain":
            return generate(self.model, prompt, self.max_tokens, self.sampling, seed=seed), None
        return speculative_generate(self.model, prompt, self.max_tokens, self.sampling, seed=seed)

    def _count(self, results: list[tuple[list[int], SpeculativeStats]]) -> None:
        for ids, s in results:
            self.stats.rounds += s.rounds
            self.stats.proposed = [a + b for a, b in zip(self.stats.proposed, s.proposed, strict=True)]
            self.stats.accepted = [a + b for a, b in zip(self.stats.accepted, s.accepted, strict=True)]
            self.emitted += len(ids)
        self._counted = True


def prompts_of(shard, n: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first `n` documents that have that many."""
    docs = (np.asarray(shard.document(d)) for d in range(shard.n_docs))
    return [doc[:length].tolist() for doc in docs if len(doc) >= length][:n]


def run(args: argparse.Namespace) -> None:
    if (
        min(args.prompts, args.prompt_tokens, args.max_new_tokens, args.rounds, args.threads) < 1
        or args.temperature < 0
    ):
        raise UserError(
            "--prompts, --prompt-tokens, --max-new-tokens, --rounds and --threads must be >= 1, --temperature >= 0"
        )
    torch.set_num_threads(args.threads)
    cfg, model, tag = load_model(*args.run)  # a missing or damaged run is a user error, named by the reader
    shard = load_split(cfg.data.out_dir, "val")
    if not cfg.model.mtp.depth:
        raise UserError(f"{args.run.run} has no MTP modules (train with model.mtp.depth=1 or more)")
    prompts = prompts_of(shard, args.prompts, args.prompt_tokens)
    if not prompts:
        raise UserError(
            f"no validation document of {args.run.run}'s data has {args.prompt_tokens} tokens (--prompt-tokens)"
        )
    decoders = Decoders(
        model, prompts, args.max_new_tokens, Sampling(args.temperature, 0, args.top_p), cfg.model.mtp.depth
    )
    greedy = args.temperature <= 0

    def same_output(r: int) -> None:
        if greedy and decoders.outputs["plain"] != decoders.outputs["mtp"]:
            sys.exit("error: greedy speculative output differs from plain greedy output")

    measures = {kind: decoders.measure(kind) for kind in ("plain", "mtp")}
    stats = summarize(interleave(measures, args.rounds, rotate=True, after_round=same_output))
    plain, mtp = stats["plain"]["tokens/s"].median, stats["mtp"]["tokens/s"].median
    s = decoders.stats
    accept = ", ".join(f"depth {j} {100 * a:.1f} %" for j, a in enumerate(s.acceptance(), start=1))
    print(
        f"{args.run.run}:{tag}, {len(prompts)} prompts of {args.prompt_tokens} tokens, {args.max_new_tokens} new "
        f"tokens each, temperature {args.temperature}, {torch.get_num_threads()} thread(s), {args.rounds} rounds"
    )
    print(f"plain {plain:,.1f} tokens/s | MTP speculative {mtp:,.1f} tokens/s | speed-up {mtp / plain:.2f}x")
    print(
        f"drafts accepted: {accept}; {decoders.emitted / max(s.rounds, 1):.2f} tokens per main-model pass"
        + ("; greedy outputs identical" if greedy else "")
    )
