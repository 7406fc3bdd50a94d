"""Sample text from a trained run (KV-cached decoding), optionally drafting with the MTP modules.

python launch/generate.py --run runs/tiny --prompt "def main(" --max-tokens 100 --temperature 0.8 --top-p 0.95
python launch/generate.py --run runs/tiny:step_00000500 --prompt "def main(" --temperature 0   # a checkpoint
python launch/generate.py --run runs/tiny_mtp --prompt "def main(" --speculative mtp             # MTP drafts

--speculative mtp drafts model.mtp.depth tokens per step with the MTP modules and verifies them in one forward pass
of the main model: greedy output is token for token the plain one, sampled output has the plain distribution.
"""

from __future__ import annotations

import argparse
import sys
import time

from moe_lm.data.tokenizer import load_data_tokenizer
from moe_lm.inference.generate import generate
from moe_lm.inference.sampling import Sampling
from moe_lm.inference.speculative import speculative_generate
from moe_lm.interop.ds_checkpoint import load_model, parse_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=parse_run, help="a run folder, or RUN:TAG for a given checkpoint")
    ap.add_argument("--prompt", default="")
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speculative", choices=["mtp"], default=None, help="draft with the run's MTP modules")
    ap.add_argument("--draft-depth", type=int, default=None, help="MTP modules to draft with (default: all)")
    args = ap.parse_args()
    if not 0 < args.top_p <= 1:
        ap.error(f"--top-p must be in (0, 1], got {args.top_p} (1 switches nucleus sampling off)")
    if args.top_k < 0:
        ap.error(f"--top-k must be >= 0 (0 switches it off), got {args.top_k}")
    try:
        cfg, model, tag = load_model(*args.run)
        tok = load_data_tokenizer(cfg.data.out_dir)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    if cfg.model.arch != "decoder" or cfg.model.attn_mask not in ("causal", "prefix"):
        sys.exit(
            f"error: {args.run.run} is an encoder (model.arch={cfg.model.arch}, attn_mask={cfg.model.attn_mask}): "
            "generation needs a decoder-only causal or prefix-LM model"
        )
    if args.speculative and not cfg.model.mtp.depth:
        sys.exit(f"error: --speculative mtp: {args.run.run} has no MTP modules (train with model.mtp.depth=1 or more)")
    prompt = [tok.doc_start_id, *tok.encode(args.prompt)]
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    t0 = time.perf_counter()
    if args.speculative:
        try:
            ids, stats = speculative_generate(model, prompt, args.max_tokens, sampling, args.seed, args.draft_depth)
        except ValueError as e:
            sys.exit(f"error: {e}")
        rates = ", ".join(f"depth {j} {100 * r:.1f} %" for j, r in enumerate(stats.acceptance(), start=1))
        seconds = time.perf_counter() - t0
        print(
            f"[{len(ids)} tokens in {stats.rounds} main-model passes, {len(ids) / seconds:.1f} tokens/s; drafts "
            f"accepted: {rates}]",
            file=sys.stderr,
        )
    else:
        ids = generate(model, prompt, args.max_tokens, sampling, args.seed)
    print(args.prompt + tok.decode(ids))


if __name__ == "__main__":
    main()
