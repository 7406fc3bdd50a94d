"""Plain autoregressive decoding with a KV cache (MLA caches only its compressed latent and rotary key)."""

from __future__ import annotations

import torch

from moe_lm.inference.sampling import Sampling
from moe_lm.model import Transformer
from moe_lm.model.attention import KVCache
from moe_lm.model.masks import mask_provider


def fit_prompt(prompt_ids: list[int], max_seq_len: int, max_tokens: int) -> tuple[list[int], int]:
    """(the prompt cut to leave `max_tokens` of room in the context, how many tokens were dropped). As HF pipelines
    truncate, the oldest tokens go, but the first one (the document-start token every training document began
    with) stays. The caller makes sure max_tokens < max_seq_len."""
    room = max_seq_len - max_tokens
    if len(prompt_ids) <= room:
        return prompt_ids, 0
    kept = prompt_ids[:1] + prompt_ids[len(prompt_ids) - (room - 1) :] if room > 1 else prompt_ids[:1]
    return kept, len(prompt_ids) - len(kept)


@torch.no_grad()
def generate(model: Transformer, prompt_ids: list[int], max_tokens: int, sampling: Sampling, seed: int) -> list[int]:
    """Up to `max_tokens` new token ids after the prompt (fewer where the context ends), one forward pass each."""
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache()
    budget = min(max_tokens, model.cfg.max_seq_len - len(prompt_ids))
    prefix = len(prompt_ids) if mask_provider(model.cfg.attn_mask).reads_prefix else None
    logits = model(torch.tensor([prompt_ids]), prefix_len=prefix, cache=cache).logits[0, -1]
    out = []
    for i in range(budget):
        out.append(sampling.sample(logits, gen))
        if i + 1 < budget:
            logits = model(torch.tensor([[out[-1]]]), cache=cache).logits[0, -1]
    return out
