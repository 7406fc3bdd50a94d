"""Sample text from a trained run (KV-cached decoding).

python launch/generate.py --run runs/tiny --prompt "def main(" --max-tokens 100 --temperature 0.8 --top-p 0.95
python launch/generate.py --run runs/tiny:step_00000500 --prompt "def main(" --temperature 0   # a checkpoint
"""

from __future__ import annotations

import argparse
import sys

import torch

from moe_lm.data.tokenizer import load_data_tokenizer
from moe_lm.interop.ds_checkpoint import load_model, parse_run
from moe_lm.model.attention import KVCache


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> int:
    """One token id from logits [V]: greedy at temperature 0, else top-k / nucleus sampling."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p  # the smallest set whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


@torch.no_grad()
def generate(model, prompt_ids: list[int], max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache()
    tokens = torch.tensor([prompt_ids])
    budget = min(max_tokens, model.cfg.max_seq_len - len(prompt_ids))
    prefix = len(prompt_ids) if model.cfg.attn_mask == "prefix" else None
    logits = model(tokens, prefix_len=prefix, cache=cache).logits[0, -1]
    out = []
    for _ in range(budget):
        nxt = sample_next(logits, temperature, top_k, top_p, gen)
        out.append(nxt)
        logits = model(torch.tensor([[nxt]]), cache=cache).logits[0, -1]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=parse_run, help="a run folder, or RUN:TAG for a given checkpoint")
    ap.add_argument("--prompt", default="")
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
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
    prompt = [tok.doc_start_id, *tok.encode(args.prompt)]
    ids = generate(model, prompt, args.max_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    print(args.prompt + tok.decode(ids))


if __name__ == "__main__":
    main()
