"""Text in, text out for a trained run: the run's tokenizer, the prompt fitted to the context (the document-start
token first, as every training document began), plain or MTP-drafted decoding."""

from __future__ import annotations

import time
from dataclasses import dataclass

from moe_lm.checkpoint.format import RunRef, load_model
from moe_lm.data.tokenizer import load_data_tokenizer
from moe_lm.errors import UserError
from moe_lm.inference.generate import fit_prompt, generate
from moe_lm.inference.sampling import Sampling
from moe_lm.inference.speculative import speculative_generate
from moe_lm.model.masks import mask_provider


@dataclass
class Generated:
    text: str  # the prompt as the model saw it, then the continuation
    notes: list[str]  # what the user should know (a cut prompt, the drafts' acceptance)


def generate_text(
    run: RunRef, prompt: str, max_new_tokens: int, sampling: Sampling, seed: int = 0,
    speculative: bool = False, draft_depth: int | None = None,
) -> Generated:  # fmt: skip
    """Continue `prompt` with up to `max_new_tokens` tokens from the run's checkpoint (speculative: drafted by its
    MTP modules and verified by the main model, which keeps the plain output's distribution)."""
    cfg, model, _ = load_model(*run)
    tok = load_data_tokenizer(cfg.data.out_dir)
    if cfg.model.arch != "decoder" or not mask_provider(cfg.model.attn_mask).decodes:
        raise UserError(
            f"{run.run} is an encoder (model.arch={cfg.model.arch}, attn_mask={cfg.model.attn_mask}): "
            "generation needs a decoder-only causal or prefix-LM model"
        )
    if speculative and not cfg.model.mtp.depth:
        raise UserError(f"--speculative mtp: {run.run} has no MTP modules (train with model.mtp.depth=1 or more)")
    context = cfg.model.max_seq_len
    if max_new_tokens >= context:
        raise UserError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in model.max_seq_len={context}")
    ids, dropped = fit_prompt([tok.doc_start_id, *tok.encode(prompt)], context, max_new_tokens)
    notes = []
    if dropped:
        notes.append(
            f"warning: the prompt has {len(ids) + dropped - 1} tokens; with --max-new-tokens {max_new_tokens} the "
            f"context (model.max_seq_len={context}) holds the last {len(ids) - 1} of them"
        )
    t0 = time.perf_counter()
    if speculative:
        new, stats = speculative_generate(model, ids, max_new_tokens, sampling, seed, draft_depth)
        rates = ", ".join(f"depth {j} {100 * r:.1f} %" for j, r in enumerate(stats.acceptance(), start=1))
        notes.append(
            f"[{len(new)} tokens in {stats.rounds} main-model passes, {len(new) / (time.perf_counter() - t0):.1f} "
            f"tokens/s; drafts accepted: {rates}]"
        )
    else:
        new = generate(model, ids, max_new_tokens, sampling, seed)
    shown = prompt if not dropped else tok.decode(ids[1:])
    return Generated(shown + tok.decode(new), notes)
