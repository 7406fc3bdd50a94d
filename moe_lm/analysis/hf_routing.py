"""Released `transformers` MoE checkpoints, seen by the routing recorder as it sees our own Transformer.

In transformers 5 every supported MoE block asks its gate module (`model.layers.<l>.mlp.gate`, a `*TopkRouter`)
for `(router_logits, topk_weights, topk_indices)` and runs exactly those experts with exactly those weights. The
recorder hooks the gate's output, so the trace holds what the model used in that forward pass (the selection bias
and the group limits included, for the architectures that have them); nothing is re-derived from logits. The
gates return their top-k unsorted; the trace orders each token's experts by gate weight, largest first. Each model
type's gate rule, with experts dropped, is what `moe-lm ablate` routes around them by (`GATE_RULES`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from moe_lm.errors import DataError
from moe_lm.interop.hf_layers import hf_forward
from moe_lm.routing.around import Rerouter, topk_without
from moe_lm.routing.torch_routing import TorchRouting

SUPPORTED = ("deepseek_v3", "deepseek_v2", "glm4_moe", "qwen2_moe", "qwen3_moe", "olmoe", "mixtral")
GATE = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate$")


def hf_routing(hf_model: nn.Module) -> TorchRouting:
    """A transformers MoE causal LM (eval mode) as a RoutedModel: its gates (`model.layers.<l>.mlp.gate`) by layer,
    their experts and top-k, and its logits, its layers called as the streamed analysis calls them
    (interop/hf_layers.py, `hf_forward`: SDPA, causal). The gates return weights and indices, not their selection
    scores, so its trace has no decision margins; the experts' output norms it has, from hooks on each layer's
    `mlp.experts` (expert_norms.py)."""
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
    experts = {layer: hf_model.get_submodule(f"model.layers.{layer}.mlp.experts") for layer in gates}
    return TorchRouting(lambda t: forward(t.to(device)), dict(sorted(gates.items())), first.num_experts, first.top_k,
                        margins=False, reroute=gate_rerouter(kind), experts=experts, ranked=False)  # fmt: skip


def declared(config, *keys: str):
    """The first of `keys` a transformers config declares (its config.json's value, not None), or None: each
    architecture names its dimensions its own way (DeepseekV3's qk_head_dim, Qwen3Moe's head_dim, Mixtral neither)."""
    values = config.to_dict()
    return next((values[key] for key in keys if values.get(key) is not None), None)


Choice = tuple[torch.Tensor, torch.Tensor]  # (gate weights [T, K], experts [T, K])


def around_sigmoid(gate: nn.Module, logits_TE: torch.Tensor, gone: list[int]) -> Choice:
    """DeepseekV3's and Glm4Moe's gate: sigmoid scores, a selection bias, group limits (the best two scores of a
    group), normalised as norm_topk_prob says and scaled."""
    scores = logits_TE.float().sigmoid()
    choice = scores + gate.e_score_correction_bias
    groups = _keep_groups(choice, gate.num_group, gate.topk_group, lambda g: g.topk(2, dim=-1).values.sum(-1))
    idx = topk_without(choice, groups, gone, gate.top_k)
    w = scores.gather(1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) if gate.norm_topk_prob else w
    return w * gate.routed_scaling_factor, idx


def around_group_softmax(gate: nn.Module, logits_TE: torch.Tensor, gone: list[int]) -> Choice:
    """DeepseekV2's gate: softmax, a group-limited greedy choice where its topk_method says (the best score of a
    group), scaled."""
    probs = logits_TE.float().softmax(dim=-1)
    n_group = gate.num_group if gate.topk_method == "group_limited_greedy" else 1
    groups = _keep_groups(probs, n_group, gate.topk_group, lambda g: g.max(dim=-1).values)
    idx = topk_without(probs, groups, gone, gate.top_k)
    return probs.gather(1, idx) * gate.routed_scaling_factor, idx


def around_softmax(gate: nn.Module, logits_TE: torch.Tensor, gone: list[int]) -> Choice:
    """Qwen2Moe's, Qwen3Moe's and OlmoE's gate: softmax top-k, renormalised as norm_topk_prob says, in the logits'
    dtype."""
    probs = logits_TE.float().softmax(dim=-1)
    idx = topk_without(probs, None, gone, gate.top_k)
    w = probs.gather(1, idx)
    w = w / w.sum(-1, keepdim=True) if gate.norm_topk_prob else w
    return w.to(logits_TE.dtype), idx


def around_mixtral(gate: nn.Module, logits_TE: torch.Tensor, gone: list[int]) -> Choice:
    """Mixtral's gate: softmax top-k, always renormalised (float32)."""
    probs = logits_TE.float().softmax(dim=-1)
    idx = topk_without(probs, None, gone, gate.top_k)
    w = probs.gather(1, idx)
    return w / w.sum(-1, keepdim=True), idx


# (gate, router logits [T, E], experts gone) -> (weights [T, K], indices [T, K]) by each supported model type's gate
# rule with `gone` dropped just before the top-k; with `gone` empty it reproduces the gate (the tests check it)
GATE_RULES = {"deepseek_v3": around_sigmoid, "glm4_moe": around_sigmoid, "deepseek_v2": around_group_softmax,
              "qwen2_moe": around_softmax, "qwen3_moe": around_softmax, "olmoe": around_softmax,
              "mixtral": around_mixtral}  # fmt: skip


def gate_rerouter(model_type: str) -> Rerouter:
    """The Rerouter of a model type's gates: its rule on the gate's own logits, the weights in the gate's dtype."""
    rule = GATE_RULES[model_type]

    def around(gate: nn.Module, out, gone: list[int]):
        w, idx = rule(gate, out[0], gone)
        return out[0], w.to(out[1].dtype), idx

    return around


def _keep_groups(choice_TE: torch.Tensor, n_group: int, topk_group: int, score) -> torch.Tensor | None:
    """[T, E] bool: experts in each token's `topk_group` best groups (None: no group limit)."""
    if not n_group or n_group <= 1:
        return None
    T, E = choice_TE.shape
    best = score(choice_TE.view(T, n_group, E // n_group)).topk(topk_group, dim=-1).indices
    keep = torch.zeros(T, n_group, dtype=torch.bool, device=choice_TE.device).scatter_(1, best, True)
    return keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
