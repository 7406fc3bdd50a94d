"""The contract between whatever routes tokens and the analytics that record it.

A `RoutedModel` routes windows of token ids (`Window`) and returns what its routers chose (`Routed`). Our
Transformer and the transformers MoE models satisfy it through `TorchRouting` (torch_routing.py), a GGUF file run in
llama.cpp through `GGUFModel` (moe_lm/interop/llama_cpp.py); each kind of subject (moe_lm/analysis/subjects/) hands
one to the recorder (moe_lm/analysis/recording.py), which writes the trace (moe_lm/analysis/trace.py).

    window --> RoutedModel.route_batch --> Routed (experts; weights, margins, log-probs if it `gives` them) --> trace

A model larger than memory runs the other way round, one layer over every window (`LayerwiseModel.route_layers`): it
hands each MoE layer's rows to the trace writer (`write_layer`) and returns the windows' log-probs when it ran every
layer.

What is required and what is optional: every routed model says which experts each token went to, in rank order
(first choice first) unless it says `ranked = False` (Megatron's router trace holds each token's experts as a set,
in id order); gate weights, decision margins and log-probs are optional, named in `gives` (a serving engine's
record, say, holds experts only), and each metric of the report says what it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

OPTIONAL = ("weights", "margins", "logprob")  # what a Routed may carry besides the experts


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
    (stats.decision_margins; NaN where the scores are not known) and each token's log-prob given the tokens before it
    in its window [N] (NaN for a window's first)."""

    experts: dict[int, np.ndarray]
    weights: dict[int, np.ndarray] | None = None
    margins: dict[int, np.ndarray] | None = None
    logprob: np.ndarray | None = None


@runtime_checkable
class RoutedModel(Protocol):
    """What the recorder records routing from (a context manager: entering it opens hooks or a model, leaving it
    closes them).

    layers:     its MoE layer ids, in the model's numbering (dense blocks count: DeepSeek-V3's first MoE layer is 3)
    n_experts:  routed experts per MoE layer
    k:          experts chosen per token
    gives:      which of OPTIONAL its Routed carries
    route_batch(windows) -> Routed: the rows of the windows, in order
    """

    layers: list[int]
    n_experts: int
    k: int
    gives: frozenset[str]

    def route_batch(self, windows: list[Window]) -> Routed: ...

    def __enter__(self) -> RoutedModel: ...

    def __exit__(self, *exc) -> None: ...


class LayerSink(Protocol):
    """Where a LayerwiseModel puts what it chose: one MoE layer's rows for every token of the windows, in order."""

    def write_layer(self, layer: int, experts, weights=None, margins=None) -> None: ...


@runtime_checkable
class LayerwiseModel(Protocol):
    """What the recorder records routing from when a model runs one layer at a time over every window (a checkpoint
    larger than memory, streamed from disk): `layers`, `n_experts`, `k`, `gives` as a RoutedModel's, and
    `route_layers(batches, sink) -> log-probs [N] or None` (None: the last layers were not run), `batches` the windows
    in the batches a RoutedModel would be given them."""

    layers: list[int]
    n_experts: int
    k: int
    gives: frozenset[str]

    def route_layers(self, batches: list[list[Window]], sink: LayerSink) -> np.ndarray | None: ...
