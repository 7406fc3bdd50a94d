"""Released `transformers` MoE checkpoints, seen by the routing recorder as it sees our own Transformer.

In transformers 5 every supported MoE block asks its gate module (`model.layers.<l>.mlp.gate`, a `*TopkRouter`)
for `(router_logits, topk_weights, topk_indices)` and runs exactly those experts with exactly those weights. The
recorder hooks the gate's output, so the trace holds what the model used in that forward pass (the selection bias
and the group limits included, for the architectures that have them); nothing is re-derived from logits. The
gates return their top-k unsorted; the trace orders each token's experts by gate weight, largest first.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from moe_lm.errors import DataError
from moe_lm.interop.hf_layers import hf_forward
from moe_lm.routing.torch_routing import TorchRouting

SUPPORTED = ("deepseek_v3", "deepseek_v2", "glm4_moe", "qwen2_moe", "qwen3_moe", "olmoe", "mixtral")
GATE = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate$")


def hf_routing(hf_model: nn.Module) -> TorchRouting:
    """A transformers MoE causal LM (eval mode) as a RoutedModel: its gates (`model.layers.<l>.mlp.gate`) by layer,
    their experts and top-k, and its logits, its layers called as the streamed analysis calls them
    (interop/hf_layers.py, `hf_forward`: SDPA, causal). The gates return weights and indices, not their selection
    scores, so its trace has no decision margins."""
    kind = hf_model.config.model_type
    if kind not in SUPPORTED:
        raise DataError(f"model_type {kind!r} is not supported for routing analytics; supported: {SUPPORTED}")
    gates = {int(m[1]): mod for name, mod in hf_model.named_modules() if (m := GATE.match(name))}
    if not gates:
        raise DataError(f"found no MoE gate modules (model.layers.<l>.mlp.gate) in this {kind} model")
    first = next(iter(gates.values()))
    hf_model.eval()
    hf_model.config._attn_implementation = "sdpa"  # causal without a mask (what hf_forward gives it)
    forward = hf_forward(hf_model)
    device = next(hf_model.parameters()).device
    return TorchRouting(lambda t: forward(t.to(device)), dict(sorted(gates.items())), first.num_experts, first.top_k,
                        margins=False)  # fmt: skip


def reroute(gate: nn.Module, logits_TE: torch.Tensor, gone: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K], indices [T, K]) by the gate's own rule on its router logits, with the `gone` experts
    dropped just before the top-k (for ablation; with `gone` empty it reproduces the gate, which the tests check).
    Three rules cover the supported gates: sigmoid scores with a selection bias and group limits (DeepseekV3,
    Glm4Moe), softmax with optional group-limited greedy choice and a scaling factor (DeepseekV2), and softmax
    top-k with optional renormalisation (Mixtral, Qwen2Moe, Qwen3Moe, OlmoE)."""
    K = gate.top_k
    logits = logits_TE.float()
    if hasattr(gate, "e_score_correction_bias"):
        scores = logits.sigmoid()
        choice = scores + gate.e_score_correction_bias
        groups = _keep_groups(choice, gate.num_group, gate.topk_group, lambda g: g.topk(2, dim=-1).values.sum(-1))
        idx = topk_without(choice, groups, gone, K)
        w = scores.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) if gate.norm_topk_prob else w
        return w * gate.routed_scaling_factor, idx
    probs = logits.softmax(dim=-1)
    if hasattr(gate, "topk_method"):
        n_group = gate.num_group if gate.topk_method == "group_limited_greedy" else 1
        groups = _keep_groups(probs, n_group, gate.topk_group, lambda g: g.max(dim=-1).values)
        idx = topk_without(probs, groups, gone, K)
        return probs.gather(1, idx) * gate.routed_scaling_factor, idx
    idx = topk_without(probs, None, gone, K)
    w = probs.gather(1, idx)
    if getattr(gate, "norm_topk_prob", True):  # Mixtral always renormalises
        w = w / w.sum(-1, keepdim=True)
    return w.to(logits_TE.dtype) if hasattr(gate, "norm_topk_prob") else w, idx


def _keep_groups(choice_TE: torch.Tensor, n_group: int, topk_group: int, score) -> torch.Tensor | None:
    """[T, E] bool: experts in each token's `topk_group` best groups (None: no group limit)."""
    if not n_group or n_group <= 1:
        return None
    T, E = choice_TE.shape
    best = score(choice_TE.view(T, n_group, E // n_group)).topk(topk_group, dim=-1).indices
    keep = torch.zeros(T, n_group, dtype=torch.bool, device=choice_TE.device).scatter_(1, best, True)
    return keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)


def topk_without(choice_TE, keep_TE, gone: list[int], K: int) -> torch.Tensor:
    """Top-K of `choice` within the kept groups minus `gone`; tokens left with fewer than K there choose from all
    experts but `gone`."""
    allowed = choice_TE.clone()
    allowed[:, gone] = float("-inf")
    if keep_TE is None:
        return allowed.topk(K, dim=-1).indices
    within = allowed.masked_fill(~keep_TE, float("-inf"))
    short = (within > float("-inf")).sum(-1, keepdim=True) < K
    return torch.where(short, allowed, within).topk(K, dim=-1).indices
