"""A token (or document) budget spread over the domains, so that per-domain statistics compare like with like.

Filling a budget in document order analyses whichever domain comes first: a folder of six domain sub-folders and a
budget smaller than the corpus gave a trace of the first domain only. Here every domain gets an equal share; a
domain with less text than its share gives the rest to the others (water-filling), so the budget is used when the
text exists, and no domain is crowded out. Within a domain documents are taken in their order, the last one cut at
the share.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


def equal_shares(available: list[int], budget: int) -> list[int]:
    """Per-domain quotas summing to min(budget, sum(available)): a common cap t, the largest with
    sum(min(a, t)) <= budget, so that a domain never gets more than it has and what it cannot take is shared by
    the others; the units left by integer division go to the earliest domains that still have text."""
    cap, left, open_domains = max(available, default=0), budget, len(available)
    for a in sorted(available):  # the smallest first: a domain below the cap takes all it has
        if a * open_domains > left:
            cap = left // open_domains
            break
        left -= a
        open_domains -= 1
    quota = [min(a, cap) for a in available]
    left = budget - sum(quota)
    for d in range(len(available)):
        extra = min(left, available[d] - quota[d])
        quota[d] += extra
        left -= extra
    return quota


@dataclass
class DomainSample:
    """What one domain contributed to an analysis."""

    tokens: int
    documents: int
    share: int  # the equal share of the budget it was offered, in the budget's unit (tokens or documents)
    under_sampled: bool  # it had less text than its share


def budget_documents(
    docs: Iterable[tuple[int, np.ndarray]], domains: list[str], max_tokens: int | None
) -> tuple[list[tuple[int, np.ndarray]], list[DomainSample]]:
    """The documents (domain index, token ids) to analyse under `max_tokens` spread equally over the domains
    (None: all of them), in domain order, and what each domain contributed. `domains` is read after `docs` is
    consumed (a reader may fill it as names appear).

    `docs` may be a long stream: per domain, documents are kept only until the domain alone fills the budget, so
    memory stays within n_domains x max_tokens ids."""
    kept: dict[int, list[np.ndarray]] = {}
    read: dict[int, int] = {}
    for domain, tokens in docs:
        if max_tokens is None or read.get(domain, 0) < max_tokens:
            kept.setdefault(domain, []).append(np.asarray(tokens))
            read[domain] = read.get(domain, 0) + len(tokens)
    n_domains = len(domains)
    read = [read.get(d, 0) for d in range(n_domains)]
    kept = [kept.get(d, []) for d in range(n_domains)]
    quota = read if max_tokens is None else equal_shares(read, max_tokens)
    share = read if max_tokens is None else equal_shares([max_tokens] * n_domains, max_tokens)
    chosen, samples = [], []
    for d in range(n_domains):
        left, n_docs = quota[d], 0
        for tokens in kept[d]:
            if left <= 0:
                break
            chosen.append((d, tokens[:left]))
            left -= len(chosen[-1][1])
            n_docs += 1
        samples.append(DomainSample(quota[d] - left, n_docs, share[d], quota[d] < share[d]))
    return chosen, samples


def budget_document_count(
    docs: list[tuple[int, np.ndarray]], n_domains: int, max_documents: int
) -> tuple[list[tuple[int, np.ndarray]], list[DomainSample]]:
    """As `budget_documents`, for a budget of whole documents (`max_documents` spread equally over the domains)."""
    by_domain: list[list[np.ndarray]] = [[] for _ in range(n_domains)]
    for domain, tokens in docs:
        by_domain[domain].append(tokens)
    quota = equal_shares([len(d) for d in by_domain], max_documents)
    share = equal_shares([max_documents] * n_domains, max_documents)
    chosen = [(d, tokens) for d in range(n_domains) for tokens in by_domain[d][: quota[d]]]
    samples = [
        DomainSample(sum(len(t) for t in by_domain[d][: quota[d]]), quota[d], share[d], quota[d] < share[d])
        for d in range(n_domains)
    ]
    return chosen, samples


def sample_lines(samples: list[DomainSample], domains: list[str], unit: str = "tokens") -> list[str]:
    """One console line per domain, and a warning for each domain that had less text than its share of the budget
    (`unit`: what the budget counts)."""
    pairs = list(zip(domains, samples, strict=True))
    lines = [f"  {name}: {s.tokens:,} tokens in {s.documents:,} documents" for name, s in pairs]
    lines += [
        f"warning: domain {name!r} is under-sampled: {s.tokens if unit == 'tokens' else s.documents:,} {unit}, "
        f"where an equal share of the budget is {s.share:,}; its statistics are noisier than the others'"
        for name, s in pairs
        if s.under_sampled
    ]
    return lines


def print_sample_lines(samples: list[DomainSample], domains: list[str], unit: str = "tokens") -> None:
    """`sample_lines` on the console: the per-domain lines on stdout, the warnings on stderr."""
    for line in sample_lines(samples, domains, unit):
        print(line, file=sys.stderr if line.startswith("warning") else sys.stdout)
