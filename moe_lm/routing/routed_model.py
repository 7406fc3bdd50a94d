"""The contract between whatever routes tokens and the analytics that record it.

A `RoutedModel` records what its routers chose for windows of token ids (`Window`) into a trace writer
(moe_lm/routing/trace.py), itself: the recorder (moe_lm/analysis/recording.py) cuts the documents into windows and
batches and asks the model nothing else. Two ways of running exist, each the model's own business:

    batch after batch (`BatchRouted`): window batch --> route_batch --> Routed --> the writer appends its rows
    layer by layer (a checkpoint larger than memory, moe_lm/analysis/streamed.py): every window through a layer,
        each MoE layer's rows written as the layer ends, the token columns last

Our Transformer and the transformers MoE models are `BatchRouted` through `TorchRouting` (torch_routing.py), a GGUF
file run in llama.cpp through `GGUFModel` (moe_lm/interop/llama_cpp.py), an engine's record through the routes kind
(moe_lm/analysis/subjects/routes.py); each kind of subject (moe_lm/analysis/subjects/) hands one to the recorder.

What is required and what is optional: every routed model says which experts each token went to, in rank order
(first choice first) unless it says `ranked = False` (Megatron's router trace holds each token's experts as a set,
in id order); gate weights, decision margins, log-probs and expert output norms are optional, named in `gives` (a
serving engine's record, say, holds experts only), and each metric of the report says what it needs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

OPTIONAL = ("weights", "margins", "logprob", "norms")  # what a Routed may carry besides the experts
DocumentIds = Iterable[tuple[int, np.ndarray]]  # (domain index, token ids) per document, in order
MAX_BATCH_LOGIT_BYTES = 1 << 30  # a forward pass's float32 logits, the largest thing a recording batch holds


@dataclass
class Window:
    """Consecutive tokens of one document, routed with the context restarting at its first token."""

    doc: int  # the document's index in the trace
    domain: int
    start: int  # the position of tokens[0] in the document
    tokens: np.ndarray


@dataclass
class Routed:
    """Routed rows (tokens in order), whoever ran them: per MoE layer id the chosen experts [N, K] (first choice
    first); with what the model `gives`, their gate weights [N, K], each decision's margin [N]
    (stats.decision_margins; NaN where the scores are not known), each token's log-prob given the tokens before it
    in its window [N] (NaN for a window's first) and the L2 norm of each chosen expert's output before its gate
    weight multiplies it [N, K] (REAP's ‖f_j(x)‖₂, moe_lm/routing/expert_norms.py)."""

    experts: dict[int, np.ndarray]
    weights: dict[int, np.ndarray] | None = None
    margins: dict[int, np.ndarray] | None = None
    logprob: np.ndarray | None = None
    norms: dict[int, np.ndarray] | None = None


class TraceSink(Protocol):
    """Where a routed model writes what it chose (moe_lm/routing/trace.py's TraceWriter): rows of every layer at once
    (`append`), or the token columns (`append_tokens`) and each MoE layer's rows for all of them (`write_layer`)."""

    def append(self, token, doc, pos, domain, routed: Routed) -> None: ...

    def append_tokens(self, token, doc, pos, domain, logprob=None) -> None: ...

    def write_layer(self, layer: int, experts, weights=None, margins=None, norms=None) -> None: ...


class Progress(Protocol):
    """A token-counting progress bar (tqdm's)."""

    def update(self, n: int) -> object: ...

    def close(self) -> None: ...


OpenBar = Callable[[], Progress]  # opens a token bar, where a routed model shows one


class Reroutable(Protocol):
    """A PyTorch model whose routers `moe-lm ablate` routes around (torch_routing.py's TorchRouting): its routers by
    MoE layer id, `forward(tokens [B, S]) -> logits [B, S, V]`, its MoE layers and routed experts per layer, and its
    routers' rule with experts dropped (`reroute`, around.py)."""

    routers: dict[int, Any]
    forward: Callable
    layers: list[int]
    n_experts: int
    reroute: Callable


@runtime_checkable
class RoutedModel(Protocol):
    """What the recorder records routing from.

    layers:     its MoE layer ids, in the model's numbering (dense blocks count: DeepSeek-V3's first MoE layer is 3)
    n_experts:  routed experts per MoE layer
    k:          experts chosen per token
    gives:      which of OPTIONAL its rows carry
    ranked:     whether each token's experts are in rank order (False: a set, in id order)
    record_into(batches, sink, progress) -> the trace's metadata it adds: every window of `batches` (the recorder's
        batches, in order) routed and written into `sink`; `progress()` opens a token bar, where it shows one
    windows_per_pass(batch_size, window_length, vocab_size) -> the windows it routes at once of a batch_size asked
    reroutable() -> the PyTorch model whose routers `moe-lm ablate` routes around, or None (not such a model)
    """

    layers: list[int]
    n_experts: int
    k: int
    gives: frozenset[str]
    ranked: bool

    def record_into(self, batches: Iterable[list[Window]], sink: TraceSink, progress: OpenBar) -> dict: ...

    def windows_per_pass(self, batch_size: int, window_length: int, vocab_size: int) -> int: ...

    def reroutable(self) -> Reroutable | None: ...


class BatchRouted(ABC):
    """A RoutedModel that routes a batch of windows at a time (`route_batch`, a context manager around the batches:
    entering it opens hooks or a model, leaving it closes them). It records itself batch after batch, ranked, each
    pass holding its batch's logits (so a batch is cut where they would not fit), and is not rerouted unless it says
    so; a subclass overrides what differs."""

    layers: list[int]
    n_experts: int
    k: int
    gives: frozenset[str]
    ranked: bool = True

    @abstractmethod
    def route_batch(self, windows: list[Window]) -> Routed:
        """The rows of the windows, in order."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def record_into(self, batches: Iterable[list[Window]], sink: TraceSink, progress: OpenBar) -> dict:
        bar = progress()
        with self:
            for batch in batches:
                sink.append(*window_columns(batch), self.route_batch(batch))
                bar.update(sum(len(w.tokens) for w in batch))
        bar.close()
        return {}

    def windows_per_pass(self, batch_size: int, window_length: int, vocab_size: int) -> int:
        return bounded_batch(batch_size, window_length, vocab_size)

    def reroutable(self) -> Reroutable | None:
        return None


def bounded_batch(batch_size: int, seq_len: int, vocab_size: int) -> int:
    """`batch_size` windows per forward pass, fewer where their logits alone would pass MAX_BATCH_LOGIT_BYTES (a
    129 k vocabulary: two 1,024-token windows)."""
    return max(1, min(batch_size, MAX_BATCH_LOGIT_BYTES // (seq_len * max(vocab_size, 1) * 4)))


def window_columns(windows: list[Window]) -> tuple[np.ndarray, ...]:
    """The token columns of windows in order: token ids, document, position, domain."""
    return (
        np.concatenate([w.tokens for w in windows]),
        np.concatenate([np.full(len(w.tokens), w.doc) for w in windows]),
        np.concatenate([np.arange(w.start, w.start + len(w.tokens)) for w in windows]),
        np.concatenate([np.full(len(w.tokens), w.domain) for w in windows]),
    )
