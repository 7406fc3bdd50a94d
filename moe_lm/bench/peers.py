"""The whole training step beside its peers: HF `DeepseekV3ForCausalLM` on the same weights, and our own dense
model of equal active FLOPs.

`moe-lm bench train --peers` adds these arms to ours (eager, and compiled):
- `HF eager`, `HF grouped_mm`: our model exported with `export_hf` and loaded by `transformers` with each of its
  expert implementations (SDPA attention), stepped with the same loss (next-token cross-entropy over the same
  positions), clipping and AdamW. HF trains no selection bias and has no sequence-wise balance loss: ours does
  that extra work in its time.
- `dense (equal active FLOPs)`: every layer dense, its MLP as wide as the shared + k routed experts of a MoE layer
  (inter_dim = (n_shared + k) x moe_inter_dim), so each token passes through the same matmul FLOPs.
"""

from __future__ import annotations

import tempfile

import torch
import torch.nn.functional as F

from moe_lm.config import Config
from moe_lm.errors import UserError


def dense_twin(cfg: Config) -> list[str]:
    """Overrides that turn a MoE config into the dense model of equal active FLOPs."""
    m = cfg.model
    width = (m.moe.n_shared_experts + m.moe.num_experts_per_tok) * m.moe.moe_inter_dim
    return [f"model.first_k_dense_replace={m.n_layers}", f"model.inter_dim={width}"]


class HFArm:
    """HF DeepseekV3ForCausalLM with the weights of `model` (our Transformer), stepped like our arms."""

    def __init__(self, name: str, cfg: Config, model, experts_implementation: str) -> None:
        import transformers

        from moe_lm.console import transformers_quiet
        from moe_lm.interop.hf import export_hf

        if cfg.model.attention != "mla" or cfg.model.mtp.depth:
            raise UserError("--peers compares with HF DeepseekV3ForCausalLM: MLA attention and model.mtp.depth=0")
        self.name, self.cfg = name, cfg
        with tempfile.TemporaryDirectory() as folder, transformers_quiet():
            export_hf(model, folder)
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32, attn_implementation="sdpa", experts_implementation=experts_implementation
            ).train()
        self.opt = None  # the caller's: every arm steps the same AdamW

    def step(self, batch: torch.Tensor) -> None:
        logits = self.model(input_ids=batch[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def gflops_per_step(self) -> float:
        from moe_lm.model import train_flops_per_token

        return train_flops_per_token(self.cfg.model, self.cfg.train.seq_len) * self.tokens / 1e9

    @property
    def tokens(self) -> int:
        return self.cfg.train.micro_batch_size * self.cfg.train.seq_len


def summary(names: list[str], medians: list[float]) -> str:
    """The ratios the README quotes: ours (eager, compiled) over HF's faster implementation and over dense."""
    t = dict(zip(names, medians, strict=True))
    hf = min(t["HF eager"], t["HF grouped_mm"])
    return (
        f"ours eager / HF best {t['ours'] / hf:.3f}; ours compiled / HF best {t['ours compiled'] / hf:.3f}; "
        f"ours eager / dense eager {t['ours'] / t['dense (equal active FLOPs)']:.3f}"
    )
