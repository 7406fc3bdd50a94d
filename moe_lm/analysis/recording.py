"""Recording: documents cut into windows and batched, routed by a `RoutedModel` (moe_lm/routing/routed_model.py)
that writes what it chose into a trace (moe_lm/routing/trace.py) as it goes, batch after batch or layer by layer, as
it runs. What was chosen is read from the model (its routers' outputs, or llama.cpp's graph), never recomputed from
logits: under biased, group-limited routing only the router knows.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from moe_lm.routing.routed_model import DocumentIds, RoutedModel, Window
from moe_lm.routing.trace import Trace, TraceWriter


def document_windows(docs: DocumentIds, seq_len: int) -> Iterator[Window]:
    """Cut each (domain, tokens) document into windows of at most seq_len tokens (context restarts per window)."""
    for d, (domain, tokens) in enumerate(docs):
        for start in range(0, len(tokens), seq_len):
            yield Window(d, domain, start, np.asarray(tokens[start : start + seq_len]))


def budgeted_windows(docs: DocumentIds, seq_len: int, max_tokens: int | None) -> Iterator[Window]:
    """`document_windows`, stopping at `max_tokens` tokens in all (the last window cut to fit; None: no limit)."""
    given = 0
    for window in document_windows(docs, seq_len):
        if max_tokens is not None:
            room = max_tokens - given
            if room <= 0:
                break
            window.tokens = window.tokens[:room]
        given += len(window.tokens)
        yield window


def window_batches(windows: Iterable[Window], batch_size: int) -> Iterator[list[Window]]:
    """Consecutive windows in batches of `batch_size` (the last one shorter)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    batch: list[Window] = []
    for window in windows:
        batch.append(window)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def record_trace(
    model: RoutedModel,
    docs: DocumentIds,
    out: str | Path,
    domains: list[str],
    seq_len: int,
    batch_size: int = 16,
    max_tokens: int | None = None,
    provenance: dict | None = None,
    progress: bool | str = True,
) -> Trace:
    """Run `model` over documents (domain index, token ids) in windows of `seq_len` and stream every token's routing
    to `out`, with the optional columns the model gives. `progress`: a progress bar (a string labels it), counting the
    tokens given when `docs` is a list."""
    writer = TraceWriter(Path(out), model.layers, model.n_experts, model.k, domains, provenance or {}, model.gives)
    t0 = time.perf_counter()
    batches = window_batches(budgeted_windows(docs, seq_len, max_tokens), batch_size)
    added = model.record_into(batches, writer, lambda: _progress_bar(docs, max_tokens, progress))
    seconds = time.perf_counter() - t0
    return writer.close({"record_seconds": seconds, "tokens_per_s": writer.n / max(seconds, 1e-9), "windows": seq_len,
                         **added, "ranked": model.ranked})  # fmt: skip


def _progress_bar(docs: DocumentIds, max_tokens: int | None, progress: bool | str) -> tqdm:
    """A token-counting bar (disabled when `progress` is False); its total is known only when `docs` is a list."""
    total = sum(len(tokens) for _, tokens in docs) if isinstance(docs, list) else None
    if max_tokens is not None:
        total = max_tokens if total is None else min(total, max_tokens)
    label = progress if isinstance(progress, str) else "recording routing"
    return tqdm(total=total, desc=label, unit="tok", disable=not progress, leave=False)
