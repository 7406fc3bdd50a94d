"""Sample text from a trained run (KV-cached decoding), optionally drafting with the MTP modules.

python launch/generate.py --run runs/tiny --prompt "def main(" --max-tokens 100 --temperature 0.8 --top-p 0.95
python launch/generate.py --run runs/tiny:step_00000500 --prompt "def main(" --temperature 0   # a checkpoint
python launch/generate.py --run runs/tiny_mtp --prompt "def main(" --speculative mtp             # MTP drafts

--speculative mtp drafts model.mtp.depth tokens per step with the MTP modules and verifies them in one forward pass
of the main model: greedy output is token for token the plain one, sampled output has the plain distribution.
A prompt longer than the context leaves (model.max_seq_len - --max-tokens) keeps its last tokens, with a warning.
"""

from __future__ import annotations

import argparse
import sys
import time

from moe_lm.checkpoint.format import load_model, parse_run
from moe_lm.cli import UserError, run
from moe_lm.data.tokenizer import load_data_tokenizer
from moe_lm.inference.generate import fit_prompt, generate
from moe_lm.inference.sampling import Sampling
from moe_lm.inference.speculative import speculative_generate
from moe_lm.model.masks import mask_provider


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=parse_run, help="a run folder, or RUN:TAG for a given checkpoint")
    ap.add_argument("--prompt", default="", help="text to continue (the document-start token is put first)")
    ap.add_argument("--max-tokens", type=int, default=120, help="new tokens to generate (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: %(default)s)")
    ap.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens; 0 is off (default: %(default)s)")
    ap.add_argument("--top-p", type=float, default=0.95, help="nucleus mass in (0, 1]; 1 is off (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    ap.add_argument("--speculative", choices=["mtp"], default=None, help="draft with the run's MTP modules")
    ap.add_argument("--draft-depth", type=int, default=None, help="MTP modules to draft with (default: all)")
    args = ap.parse_args()
    if not 0 < args.top_p <= 1:
        ap.error(f"--top-p must be in (0, 1], got {args.top_p} (1 switches nucleus sampling off)")
    if args.top_k < 0:
        ap.error(f"--top-k must be >= 0 (0 switches it off), got {args.top_k}")
    if not args.temperature >= 0:  # why `not >=`: NaN is refused too
        ap.error(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    if args.max_tokens < 1:
        ap.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    cfg, model, tag = load_model(*args.run)
    tok = load_data_tokenizer(cfg.data.out_dir)
    if cfg.model.arch != "decoder" or not mask_provider(cfg.model.attn_mask).decodes:
        raise UserError(
            f"{args.run.run} is an encoder (model.arch={cfg.model.arch}, attn_mask={cfg.model.attn_mask}): "
            "generation needs a decoder-only causal or prefix-LM model"
        )
    if args.speculative and not cfg.model.mtp.depth:
        raise UserError(f"--speculative mtp: {args.run.run} has no MTP modules (train with model.mtp.depth=1 or more)")
    context = cfg.model.max_seq_len
    if args.max_tokens >= context:
        raise UserError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in model.max_seq_len={context}")
    prompt, dropped = fit_prompt([tok.doc_start_id, *tok.encode(args.prompt)], context, args.max_tokens)
    if dropped:
        print(
            f"warning: the prompt has {len(prompt) + dropped - 1} tokens; with --max-tokens {args.max_tokens} "
            f"the context (model.max_seq_len={context}) holds the last {len(prompt) - 1} of them",
            file=sys.stderr,
        )
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    t0 = time.perf_counter()
    if args.speculative:
        ids, stats = speculative_generate(model, prompt, args.max_tokens, sampling, args.seed, args.draft_depth)
        rates = ", ".join(f"depth {j} {100 * r:.1f} %" for j, r in enumerate(stats.acceptance(), start=1))
        seconds = time.perf_counter() - t0
        print(
            f"[{len(ids)} tokens in {stats.rounds} main-model passes, {len(ids) / seconds:.1f} tokens/s; drafts "
            f"accepted: {rates}]",
            file=sys.stderr,
        )
    else:
        ids = generate(model, prompt, args.max_tokens, sampling, args.seed)
    shown = args.prompt if not dropped else tok.decode(prompt[1:])
    print(shown + tok.decode(ids))


if __name__ == "__main__":
    run(main)
