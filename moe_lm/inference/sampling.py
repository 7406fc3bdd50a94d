"""The next-token distribution a decoding setting samples from, and one draw from it.

Both plain and speculative decoding go through `next_token_probs`, so speculative sampling reproduces exactly the
distribution plain sampling draws from (temperature, top-k and nucleus filtering included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 0.95

    def probs(self, logits_V: torch.Tensor) -> torch.Tensor:
        """The distribution [V] to sample the next token from: one-hot on the argmax when greedy."""
        if self.temperature <= 0:
            return torch.zeros_like(logits_V, dtype=torch.float32).scatter_(0, logits_V.argmax().view(1), 1.0)
        logits = logits_V.float() / self.temperature
        if self.top_k > 0:
            kth = logits.topk(min(self.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if self.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < self.top_p  # the smallest set whose mass reaches top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        return probs / probs.sum()

    def sample(self, logits_V: torch.Tensor, gen: torch.Generator) -> int:
        """One token id from logits [V] (greedy: the argmax, drawing nothing from `gen`)."""
        if self.temperature <= 0:
            return int(logits_V.argmax())
        return draw(self.probs(logits_V), gen)


def draw(probs_V: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(probs_V, 1, generator=gen))
