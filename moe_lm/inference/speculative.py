"""Speculative decoding with the MTP modules as the draft model (DeepSeek-V3 §2.2 and §5.4.3).

Each round, with true tokens t_0 .. t_N known and the main model's cache holding positions 0 .. N-1:
1. draft: MTP module 1 at position N-1 reads h^0_{N-1} and t_N and proposes d_1 ~ q_1; module k reads h^{k-1}_{N-1}
   and d_{k-1} and proposes d_k ~ q_k (D drafts from D modules);
2. verify: one main-model forward over [t_N, d_1, .., d_D] gives p_0 .. p_D, the distributions plain decoding would
   sample t_{N+1} .. t_{N+D+1} from;
3. accept (Leviathan et al. 2023; Chen et al. 2023): d_j is kept with probability min(1, p_{j-1}(d_j) / q_j(d_j));
   at the first rejection the token is drawn from max(p_{j-1} - q_j, 0) (normalised) and the round ends; when all
   D are kept, one more token is drawn from p_D. Every emitted token is then distributed exactly as in plain
   decoding; greedy decoding (one-hot p and q) keeps a draft iff it is the main model's argmax, so the output is
   token for token the plain greedy output.
4. roll back: the main cache keeps the positions whose inputs were true tokens; module k keeps the positions i whose
   inputs t_{i+1} .. t_{i+k} are now all known to be true (i + k <= the last accepted position).

The MTP modules keep their own KV caches and hidden states, so a round costs one main forward over D + 1 tokens
plus each module over the positions accepted since the last round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_lm.errors import ConfigError
from moe_lm.inference.sampling import Sampling, draw
from moe_lm.model import Transformer
from moe_lm.model.attention import KVCache, decode_mask, rope_cos_sin


@dataclass
class SpeculativeStats:
    rounds: int = 0  # main-model forward passes after the prompt
    proposed: list[int] = field(default_factory=list)  # per depth j: drafts d_j proposed
    accepted: list[int] = field(default_factory=list)  # per depth j: drafts d_j accepted (d_1 .. d_j all kept)

    def acceptance(self) -> list[float]:
        """Per depth j: the share of proposed d_j that were accepted (DeepSeek-V3 reports 85-90 % for j = 1)."""
        return [a / p if p else float("nan") for a, p in zip(self.accepted, self.proposed, strict=True)]


def accept_or_resample(p_V: torch.Tensor, q_V: torch.Tensor, draft: int, gen: torch.Generator) -> tuple[bool, int]:
    """The rejection rule: keep `draft` (drawn from q) with probability min(1, p/q), else draw from the normalised
    max(p - q, 0). The returned token is distributed as p."""
    u = float(torch.rand((), generator=gen))
    if u * float(q_V[draft]) < float(p_V[draft]):
        return True, draft
    residual = (p_V - q_V).clamp_min(0)
    # why the guard: p == q up to rounding leaves no residual mass (and then a rejection had probability ~0)
    return False, draw(residual / residual.sum() if residual.sum() > 0 else p_V, gen)


class _Drafter:
    """The MTP modules' state across rounds: per depth k, a KV cache and the hidden states h^k of the positions
    computed from true tokens only."""

    def __init__(self, model: Transformer, depth: int) -> None:
        self.model = model
        self.modules = list(model.mtp)[:depth]
        self.caches = [KVCache() for _ in self.modules]
        self.hidden: list[torch.Tensor | None] = [None] * len(self.modules)  # [positions, D] per depth

    def propose(self, tokens: list[int], h0: torch.Tensor, n_drafts: int, sampling: Sampling, gen) -> tuple:
        """Drafts d_1 .. d_n for t_{N+1} .. t_{N+n} (N = len(tokens) - 1) and their distributions q_1 .. q_n."""
        model, N = self.model, len(tokens) - 1
        ext = list(tokens)  # true tokens, then the drafts so far
        drafts, qs = [], []
        prev = h0  # h^{k-1} for positions 0 .. N-1
        for k, module in enumerate(self.modules[:n_drafts], start=1):
            cache = self.caches[k - 1]
            start = cache.length
            positions = torch.arange(start, N)
            cos, sin = rope_cos_sin(model.inv_freq, positions, h0.dtype, model.rope_factor)
            emb = model.embed_tokens(torch.tensor([ext[start + k : N + k]]))
            mask = None if start == 0 else decode_mask(N - start, start, h0.device)
            h_new, _ = module(prev[start:N][None], emb, cos, sin, mask, cache)
            cache.length = N
            old = self.hidden[k - 1]
            prev = h_new[0] if old is None else torch.cat((old[:start], h_new[0]))
            self.hidden[k - 1] = prev
            logits = model.lm_head(module.shared_head.norm(prev[N - 1]))
            q = sampling.probs(logits)
            drafts.append(draw(q, gen))
            qs.append(q)
            ext.append(drafts[-1])
        return drafts, qs

    def keep_true(self, last_true: int) -> None:
        """Drop positions whose inputs included a rejected draft: depth k keeps i with i + k <= last_true."""
        for k, cache in enumerate(self.caches, start=1):
            keep = max(0, min(cache.length, last_true - k + 1))
            cache.truncate(keep)
            if self.hidden[k - 1] is not None:
                self.hidden[k - 1] = self.hidden[k - 1][:keep]


@torch.no_grad()
def speculative_generate(
    model: Transformer, prompt_ids: list[int], max_tokens: int, sampling: Sampling, seed: int, depth: int | None = None
) -> tuple[list[int], SpeculativeStats]:
    """Up to `max_tokens` new token ids after the prompt, drafted by `depth` MTP modules (all by default) and
    verified by the main model; plus the acceptance statistics."""
    D = len(model.mtp) if depth is None else depth
    if not 1 <= D <= len(model.mtp):
        raise ConfigError(
            f"speculative decoding with MTP needs 1..{len(model.mtp)} modules (the model has "
            f"{len(model.mtp)}; train with model.mtp.depth > 0), got {D}"
        )
    if model.cfg.attn_mask != "causal":
        raise ConfigError("speculative decoding with MTP needs a causal model")
    gen = torch.Generator().manual_seed(seed)
    stats = SpeculativeStats(proposed=[0] * D, accepted=[0] * D)
    cache, drafter = KVCache(), _Drafter(model, D)
    budget = min(max_tokens, model.cfg.max_seq_len - len(prompt_ids))
    if budget <= 0:
        return [], stats
    out = model(torch.tensor([prompt_ids]), cache=cache)
    h0 = out.hidden[0]  # [positions, D]: h^0 of every position the main cache holds
    tokens = [*prompt_ids, sampling.sample(out.logits[0, -1], gen)]
    while len(tokens) - len(prompt_ids) < budget:
        n_drafts = min(D, budget - (len(tokens) - len(prompt_ids)) - 1)
        drafts, qs = drafter.propose(tokens, h0, n_drafts, sampling, gen)
        N = len(tokens) - 1
        verify = model(torch.tensor([[tokens[-1], *drafts]]), cache=cache)
        stats.rounds += 1
        new = []
        for j, (d, q) in enumerate(zip(drafts, qs, strict=True)):
            stats.proposed[j] += 1
            ok, token = accept_or_resample(sampling.probs(verify.logits[0, j]), q, d, gen)
            new.append(token)
            if not ok:
                break
            stats.accepted[j] += 1
        else:  # every draft kept: the verify pass already gives the distribution of the next token
            new.append(sampling.sample(verify.logits[0, len(drafts)], gen))
        a = len(new) - 1  # drafts accepted
        cache.truncate(N + a + 1)  # positions N .. N + a held t_N, d_1 .. d_a: true tokens
        h0 = torch.cat((h0, verify.hidden[0, : a + 1]))
        drafter.keep_true(N + a)
        tokens += new
    return tokens[len(prompt_ids) :][:budget], stats
