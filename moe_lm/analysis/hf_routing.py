"""Released `transformers` MoE checkpoints, seen by the routing recorder as it sees our own Transformer.

In transformers 5 every supported MoE block asks its gate module (`model.layers.<l>.mlp.gate`, a `*TopkRouter`)
for `(router_logits, topk_weights, topk_indices)` and runs exactly those experts with exactly those weights. The
recorder hooks the gate's output, so the trace holds what the model used in that forward pass (the selection bias
and the group limits included, for the architectures that have them); nothing is re-derived from logits. The
gates return their top-k unsorted; the trace orders each token's experts by gate weight, largest first.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch
from torch import nn

SUPPORTED = ("deepseek_v3", "deepseek_v2", "glm4_moe", "qwen2_moe", "qwen3_moe", "olmoe", "mixtral")
GATE = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate$")


class HFMoEModel(nn.Module):
    """A transformers causal LM with the interface `record_trace` uses: forward(tokens [B, S]), moe_layer_ids(),
    routers() (the gate modules), and cfg.moe.{n_routed_experts, num_experts_per_tok}."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        kind = hf_model.config.model_type
        if kind not in SUPPORTED:
            raise ValueError(f"model_type {kind!r} is not supported for routing analytics; supported: {SUPPORTED}")
        self.hf = hf_model
        self.gates = {int(m[1]): mod for name, mod in hf_model.named_modules() if (m := GATE.match(name))}
        if not self.gates:
            raise ValueError(f"found no MoE gate modules (model.layers.<l>.mlp.gate) in this {kind} model")
        first = next(iter(self.gates.values()))
        # why a config-shaped namespace: the recorder reads our Transformer's cfg.moe for the same two numbers
        self.cfg = SimpleNamespace(
            moe=SimpleNamespace(n_routed_experts=first.num_experts, num_experts_per_tok=first.top_k),
            attn_mask="causal",
        )

    def forward(self, tokens_BS: torch.Tensor):
        return self.hf(input_ids=tokens_BS.to(self.hf.device))

    def moe_layer_ids(self) -> list[int]:
        return sorted(self.gates)

    def routers(self) -> list[nn.Module]:
        return [self.gates[layer] for layer in self.moe_layer_ids()]


def parameter_count(config) -> int:
    """Parameters of the model a transformers config describes, counted on the meta device (nothing allocated)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def gate_choices(output) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [T, K], weights [T, K]) from an HF gate's (logits, weights, indices), largest weight first."""
    _, weights, indices = output
    order = weights.float().argsort(dim=-1, descending=True, stable=True)
    return indices.gather(-1, order), weights.float().gather(-1, order)
