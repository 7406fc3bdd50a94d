"""A PyTorch model as a `RoutedModel`: its routers' choices through forward hooks (recorder.py) and each token's
log-prob from its logits. Our Transformer (`transformer_routing`) and a transformers MoE model (the hf subject kind,
moe_lm/analysis/hf_routing.py) are both one: a forward function, the routers by MoE layer id, and the two numbers
the trace needs, and the norms of their experts' outputs (expert_norms.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from moe_lm.config import ConfigError
from moe_lm.model import Transformer
from moe_lm.routing.around import Rerouter, around_ours
from moe_lm.routing.expert_norms import ExpertNormRecorder
from moe_lm.routing.recorder import RoutingRecorder
from moe_lm.routing.routed_model import BatchRouted, Routed, Window


class TorchRouting(BatchRouted):
    """`forward(tokens [B, S]) -> logits [B, S, V]` run right-padded over a batch of windows in one pass (causal:
    padding cannot reach a real token); `routers`: the modules whose outputs say what was chosen, by MoE layer id
    (those on the inference path: MTP modules do not run); `margins`: whether the routers' outputs carry the
    selection scores (ours do; transformers' gates return weights and indices only); `reroute`: the routers' rule
    with experts dropped (around.py), by which `moe-lm ablate` routes around them (`reroutable`); `experts`: the
    experts modules by MoE layer id (ours, or transformers'), whose output norms the trace then carries (None: not
    recorded), in the recorder's order (`ranked`: the router's own; else largest gate weight first)."""

    def __init__(self, forward: Callable, routers: dict[int, nn.Module], n_experts: int, k: int, margins: bool,
                 reroute: Rerouter, experts: dict[int, nn.Module] | None = None,
                 ranked: bool = True) -> None:  # fmt: skip
        self.forward, self.routers, self.reroute = forward, routers, reroute
        self.layers, self.n_experts, self.k = sorted(routers), n_experts, k
        self.gives = frozenset(
            {"weights", "logprob", *(["margins"] if margins else []), *(["norms"] if experts else [])}
        )
        self.recorder = RoutingRecorder(routers, margins=margins, parts=True)  # cleared before each forward
        self.norms = ExpertNormRecorder(experts, ranked) if experts else None

    def __enter__(self) -> TorchRouting:
        self.recorder.__enter__()
        if self.norms is not None:
            self.norms.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.recorder.__exit__(*exc)
        if self.norms is not None:
            self.norms.__exit__(*exc)

    def reroutable(self) -> TorchRouting:
        return self

    @torch.no_grad()
    def route_batch(self, windows: list[Window]) -> Routed:
        S = max(len(w.tokens) for w in windows)
        tokens = torch.zeros(len(windows), S, dtype=torch.long)
        valid = torch.zeros(len(windows), S, dtype=torch.bool)
        for b, w in enumerate(windows):
            tokens[b, : len(w.tokens)] = torch.from_numpy(w.tokens.astype(np.int64))
            valid[b, : len(w.tokens)] = True
        self.recorder.last.clear()
        self.recorder.margins.clear()
        if self.norms is not None:
            self.norms.clear()
        logits = self.forward(tokens)
        real = valid.flatten()
        norms = {layer: self.norms.take(layer)[real].numpy() for layer in self.layers} if self.norms else None
        return Routed(
            {layer: self.recorder.last[layer][0][real].numpy() for layer in self.layers},
            {layer: self.recorder.last[layer][1][real].numpy() for layer in self.layers},
            {layer: m.reshape(-1)[real.numpy()] for layer, m in self.recorder.margins.items()} or None,
            np.concatenate(
                [window_logprobs(logits[b, : len(w.tokens)], tokens[b, : len(w.tokens)]) for b, w in enumerate(windows)]
            ),  # fmt: skip
            norms,
        )


def transformer_routing(model: Transformer) -> TorchRouting:
    """Our Transformer as a RoutedModel: its decoder's MoE layers (the inference path: MTP modules do not run)."""
    if model.cfg.attn_mask != "causal":
        raise ConfigError("recording needs a causal model (padding would leak into a bidirectional prefix)")
    model.eval()
    decoder = {i: r for i, r in zip(model.moe_layer_ids(), model.routers(), strict=True) if i < model.cfg.n_layers}
    experts = {i: m.experts for i, m in zip(model.moe_layer_ids(), model.moe_layers(), strict=True) if i in decoder}
    moe = model.cfg.moe
    return TorchRouting(lambda tokens: model(tokens).logits, decoder, moe.n_routed_experts, moe.num_experts_per_tok,
                        margins=True, reroute=around_ours, experts=experts)  # fmt: skip


def window_logprobs(logits_SV: torch.Tensor, tokens_S: torch.Tensor) -> np.ndarray:
    """log p(token t | tokens < t) in one window [S] (NaN at t = 0), without holding its whole softmax."""
    logits = logits_SV[:-1].float()
    picked = logits.gather(-1, tokens_S[1:, None].to(logits.device))[:, 0] - torch.logsumexp(logits, dim=-1)
    return np.concatenate([[np.nan], picked.cpu().double().numpy()])
