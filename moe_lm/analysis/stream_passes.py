"""The passes of a streamed analysis (moe_lm/analysis/streamed.py) over every window's hidden states in its work
folder (stream_work.py): a layer's attention and router a few windows at a time (`run_layer`), then its routed
experts, whole over each batch or a chunk of them at a time (`run_experts`), in the order transformers' own experts
module adds them, so that a model run whole (interop/hf_layers.py, `hf_forward`) gives the same bits."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from moe_lm.analysis.stream_plan import Unit
from moe_lm.analysis.stream_work import WorkFolder
from moe_lm.interop.hf_layers import HFCheckpoint, experts_deferred, windows_at_once
from moe_lm.routing.expert_norms import slot_norms
from moe_lm.routing.recorder import gate_choices
from moe_lm.routing.routed_model import Window


def padded_batch(batch: list[Window]) -> tuple[torch.Tensor, list[int]]:
    """A batch's token ids, right-padded with 0 as the in-memory recorder pads them, and each window's length."""
    S = max(len(w.tokens) for w in batch)
    tokens = torch.zeros(len(batch), S, dtype=torch.long)
    for b, w in enumerate(batch):
        tokens[b, : len(w.tokens)] = torch.from_numpy(np.asarray(w.tokens, np.int64))
    return tokens, [len(w.tokens) for w in batch]


def run_layer(layer, unit: Unit, state: WorkFolder, padded, ck: HFCheckpoint, rotary) -> None:
    """Layer `unit.layer` over every batch: attention and router `windows_at_once` windows at a time, a MoE layer's
    routed experts deferred (what they need kept: the residual `h`, the MoE's output without them `y`, their input
    `t`, the choices); in a whole unit, then the experts over each batch at once (transformers' own module, as the
    model run whole calls it) and the layer's output written; else they come in chunks (`run_experts`)."""
    moe = unit.layer in ck.moe_layers
    experts = layer.mlp.experts if moe else None
    gate: dict = {}
    with contextlib.ExitStack() as stack:
        if moe:
            stack.callback(layer.mlp.gate.register_forward_hook(lambda m, a, out: gate.__setitem__("out", out)).remove)
            kept = stack.enter_context(experts_deferred(layer))
        for b, (_, lengths) in enumerate(padded):
            B, S = state.shapes[b][:2]
            position_ids = torch.arange(S)[None]
            cos_sin = rotary(state.hidden(b, "in"), position_ids)
            step = windows_at_once(ck.config, S)
            for j in range(0, B, step):
                rows = slice(j, min(j + step, B))
                # transformers 5's decoder layers return the hidden states (a tensor, no tuple)
                out = layer(state.hidden(b, "in")[rows], attention_mask=None, position_ids=position_ids,
                            position_embeddings=cos_sin)  # fmt: skip
                if not moe:
                    state.hidden(b, "out")[rows] = out
                    continue
                state.keep_choices(unit.layer, (b, j), *gate_choices(gate["out"]), lengths[rows])
                state.part(b, "h")[rows] = kept["h"]
                state.part(b, "y")[rows] = kept["y"]
                state.keep_expert_input(b, rows, kept["t"], kept["idx"], kept["w"])
            if moe and unit.whole:
                t, idx, w = state.expert_input(b)
                state.norms(b)[:] = slot_norms(experts, t, idx)  # one more pass: the module combines the slots
                state.finish_batch(b, experts(t, idx, w).view(state.shapes[b]))
            elif moe:
                state.part(b, "e")[:] = 0  # the experts' sum, added to chunk by chunk


def run_experts(weights, unit: Unit, state: WorkFolder, padded, ck: HFCheckpoint) -> int:
    """A chunk of layer `unit.layer`'s routed experts, each over every token of a batch that chose it, added into
    their sum in increasing expert order, as transformers' experts module does over the batch in a whole layer, each
    output's norm before its weight kept (`WorkFolder.norms`); the (token, expert) rows run."""
    gate_up, down = weights
    act = ck.activation()
    rows = 0
    for b in range(len(padded)):
        t, idx, w = state.expert_input(b)
        final, norms = state.part(b, "e").view(-1, t.shape[-1]), state.norms(b)
        mask = torch.nn.functional.one_hot(idx, num_classes=ck.n_experts + 1).permute(2, 1, 0)
        for j, e in enumerate(unit.experts):
            if not mask[e].any():
                continue
            top_k_pos, token_idx = torch.where(mask[e])
            rows += len(token_idx)
            g, u = torch.nn.functional.linear(t[token_idx], gate_up[j]).chunk(2, dim=-1)
            h = torch.nn.functional.linear(act(g) * u, down[j])
            norms[token_idx, top_k_pos] = h.float().norm(dim=-1)
            h = h * w[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, h.to(final.dtype))
    return rows
